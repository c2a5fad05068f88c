"""The build's GPU-architecture decisions (setup.py) and the runtime check, with fake capabilities."""
import pytest
import torch

import adept_ext
from adept_ext import _cuda_arch, ops
from adept_ext._cuda_arch import choose_arch_list, parse_arch_list, runs_on
from adept_ext.ops import checks


def test_choose_respects_the_users_setting():
    assert choose_arch_list("8.0;8.6+PTX", [(9, 0)]) == "8.0;8.6+PTX"
    assert choose_arch_list(" Ampere ", []) == "Ampere"


@pytest.mark.parametrize("env", [None, "", "native"])
def test_choose_builds_for_the_visible_gpus_plus_ptx(env):
    assert choose_arch_list(env, [(8, 0)]) == "8.0+PTX"
    assert choose_arch_list(env, [(8, 9), (8, 0), (8, 9)]) == "8.0;8.9+PTX"
    assert choose_arch_list(env, [(12, 0)], max_supported=(10, 0)) == "10.0+PTX"  # clamped as torch does


@pytest.mark.parametrize("env", [None, "", "native"])
def test_choose_defaults_to_the_cards_users_have_without_a_gpu(env):
    assert choose_arch_list(env, []) == "8.0;8.6;8.9;9.0+PTX"
    default = _cuda_arch.DEFAULT_ARCH_LIST
    for capability in [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0)]:  # A100 ... RTX 50xx (PTX)
        assert runs_on(default, capability), capability
    assert not runs_on(default, (7, 5))  # T4: not targeted (CUDA 13 dropped it)


def test_parse_arch_list():
    assert parse_arch_list("8.0 8.6+PTX,9.0a") == [(8, 0, "", False), (8, 6, "", True), (9, 0, "a", False)]
    assert parse_arch_list("Hopper") == [(9, 0, "", True)]
    with pytest.raises(ValueError, match="sm_90"):
        parse_arch_list("sm_90")


@pytest.mark.parametrize("arch_list,capability,ok", [
    ("9.0", (9, 0), True),          # H100/H200
    ("9.0", (8, 0), False),         # A100: no sm_80 code, no PTX
    ("9.0", (8, 9), False),         # L4
    ("9.0", (10, 0), False),        # B200: SASS does not cross a major version
    ("9.0+PTX", (10, 0), True),     # ... but PTX is JIT-compiled forward
    ("9.0+PTX", (8, 6), False),     # PTX never runs backward
    ("8.0", (8, 6), True),          # same major, higher minor
    ("8.6", (8, 0), False),
    ("9.0a", (9, 0), True),
    ("9.0a", (9, 1), False),        # arch-specific code runs on exactly that arch
    ("8.0;9.0", (8, 9), True),
    ("Ampere", (8, 7), True),
])
def test_runs_on(arch_list, capability, ok):
    assert runs_on(arch_list, capability) is ok
    assert (_cuda_arch.mismatch_message(arch_list, capability) is None) is ok


@pytest.fixture
def fake_gpu(monkeypatch):
    """A build with CUDA kernels for `arch_list` on one visible GPU of `capability`."""
    def install(arch_list, capability):
        monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
        monkeypatch.setattr(checks, "compiled_cuda_arch_list", lambda: arch_list)
        ops.check_cuda_device.cache_clear()
    yield install
    ops.check_cuda_device.cache_clear()


def test_cuda_available_fails_clearly_on_a_gpu_the_build_cannot_run_on(fake_gpu):
    fake_gpu("9.0", (8, 0))
    with pytest.raises(RuntimeError, match=r"TORCH_CUDA_ARCH_LIST='9.0'.*Fake GPU.*capability 8.0.*8.0\+PTX"):
        adept_ext.cuda_available()
    with pytest.raises(RuntimeError, match="capability 8.0"):  # the first op call on that GPU, too
        ops.check_device_arch(torch.device("cuda"))


def test_cuda_available_on_a_gpu_the_build_runs_on(fake_gpu):
    fake_gpu("8.0;9.0+PTX", (9, 0))
    assert adept_ext.cuda_available() is True
    ops.check_device_arch(torch.device("cuda", 0))


def test_unrecorded_arch_list_is_not_an_error(fake_gpu):
    fake_gpu(None, (8, 0))  # a build that predates the record: the launch reports for itself
    assert adept_ext.cuda_available() is True


@pytest.mark.parametrize("version,built,problem", [
    ("2.14.1+cu130", None, None),
    ("2.11.0", "2.11.0+cu130", None),
    ("2.12.0a0+git1234", "2.12.1", None),          # local and pre-release labels: major.minor counts
    ("2.10.0", None, "supports torch 2.11 to 2.14"),
    ("2.15.0.dev20260101", None, "supports torch 2.11 to 2.14"),
    ("2.14.1", "2.13.0", "built against torch 2.13.0 but torch 2.14.1 is installed: rebuild"),
    ("2.10.0", "2.10.0", "supports torch 2.11 to 2.14"),  # rebuilding would not help: the range comes first
])
def test_torch_problem(version, built, problem):
    found = _cuda_arch.torch_problem(version, built)
    assert (found is None) if problem is None else (problem in found and "\n" not in found)


def test_an_untested_torch_can_be_let_through_but_not_a_mismatched_build():
    assert _cuda_arch.torch_problem("2.15.0", "2.15.1", allow_untested=True) is None
    assert "rebuild" in _cuda_arch.torch_problem("2.15.0", "2.14.1", allow_untested=True)
    assert "install torch>=2.11,<2.15 and rebuild" in _cuda_arch.torch_problem("2.10.0")


def test_this_build_records_its_arch_list():
    # setup.py writes adept_ext/_build_info.py; a CPU-only build records None
    arch_list = adept_ext.compiled_cuda_arch_list()
    assert (arch_list is not None) == adept_ext.cuda_available()
    if arch_list is not None:
        parse_arch_list(arch_list)
