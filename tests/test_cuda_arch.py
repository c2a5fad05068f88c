"""The build's GPU-architecture decisions (setup.py) and the runtime check, with fake capabilities."""
import pytest
import torch

import adept_ext
from adept_ext import _cuda_arch, ops
from adept_ext.ops import checks
from adept_ext._cuda_arch import choose_arch_list, parse_arch_list, runs_on


def test_choose_respects_the_users_setting():
    assert choose_arch_list("8.0;8.6+PTX", [(9, 0)]) == "8.0;8.6+PTX"
    assert choose_arch_list(" Ampere ", []) == "Ampere"


@pytest.mark.parametrize("env", [None, "", "native"])
def test_choose_builds_for_the_visible_gpus_plus_ptx(env):
    assert choose_arch_list(env, [(8, 0)]) == "8.0+PTX"
    assert choose_arch_list(env, [(8, 9), (8, 0), (8, 9)]) == "8.0;8.9+PTX"
    assert choose_arch_list(env, [(12, 0)], max_supported=(10, 0)) == "10.0+PTX"  # clamped as torch does


@pytest.mark.parametrize("env", [None, "", "native"])
def test_choose_defaults_to_hopper_without_a_gpu(env):
    assert choose_arch_list(env, []) == "9.0"


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


def test_this_build_records_its_arch_list():
    # setup.py writes adept_ext/_build_info.py; a CPU-only build records None
    arch_list = adept_ext.compiled_cuda_arch_list()
    assert (arch_list is not None) == adept_ext.cuda_available()
    if arch_list is not None:
        parse_arch_list(arch_list)
