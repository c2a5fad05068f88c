"""tools/gpu_check.sh without a GPU: its plan (DRY_RUN), every step's imports and argument parsing
with a Python like the device's (EMULATE), and tools/gpu_summary.py's merge."""
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile

import pytest
import torch

import adept_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_summary  # noqa: E402

CALL1 = ["build", "import", "tests", "racecheck", "bench_importance_large", "bench_projection_large", "bench_lr_large"]
CALL2 = ["build", "import", "memcheck"]
CALL3 = ["build", "import", "peers", "quant", "bench_linear_ce_large", "bench_train_step_large", "bench_probe_large"]
ALL = CALL1 + CALL2[2:] + CALL3[2:]
SETTINGS = ("PYTHONPATH", "PYTHON", "DRY_RUN", "EMULATE", "STEPS", "CALL", "BUDGET_S", "WORK", "WHEELS", "FULL_TABLE",
            "PYTEST_ADDOPTS")


def run_script(out, **env):
    """gpu_check.sh OUT with these settings only (none inherited from the caller's environment)."""
    env = {**{k: v for k, v in os.environ.items() if k not in SETTINGS}, "PYTHON": sys.executable,
           "WORK": str(out / "work"), **env}
    return subprocess.run(["bash", SCRIPT, str(out / "out")], env=env, capture_output=True, text=True, timeout=300)


def summary_of(out, label="all"):
    return json.loads((out / "out" / f"gpu-check-{label}.json").read_text())


def test_syntax():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_run_prints_three_calls_of_at_most_420_s(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "peer-1.0-py3-none-any.whl").write_text("")
    proc = run_script(tmp_path, DRY_RUN="1", WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    calls = re.split(r"^call \d: ", text, flags=re.M)[1:]
    assert len(calls) == 3
    for n, (call, steps) in enumerate(zip(calls, (CALL1, CALL2, CALL3)), 1):
        assert f"returns 2 files (at most 8): gpu-check-call{n}.json gpu-check-call{n}.tar.gz" in call
        assert re.findall(r"^  (\w+) +\d+ s ", call, flags=re.M) == steps
        limits = [int(s) for s in re.findall(r"^  \w+ +(\d+) s ", call, flags=re.M)]
        assert f"sum of the limits: {sum(limits)} s of at most 420 s" in call and sum(limits) <= 420
    line = {name: next(s for s in text.splitlines() if s.startswith(f"  {name} "))
            for name in CALL1 + CALL2 + CALL3}
    assert "pip install --no-index --no-deps --no-compile" in line["peers"]
    assert "--size large" in line["bench_train_step_large"] and "--full-table" not in line["bench_train_step_large"]
    full = run_script(tmp_path, DRY_RUN="1", CALL="3", FULL_TABLE="1").stdout
    assert "train_step --size large --device cuda --json $WORK/bench/train_step_large.json --full-table" in full
    assert "NVCC_APPEND_FLAGS=-lineinfo" in line["build"] and "build_ext --inplace" in line["build"]
    assert "--continue-on-collection-errors" in line["tests"] and "tests/test_frozen_dtype.py" not in line["tests"]
    for tool in ("memcheck", "racecheck"):  # -v: a log names each test as it starts
        assert f"--tool {tool} --kernel-name kns=adept_ext" in line[tool] and " -x " not in line[tool]
        assert " -m pytest -v " in line[tool]
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in line["memcheck"] and "not graph" in line["memcheck"]
    assert "<import bitsandbytes, else fail saying so>" in line["quant"]
    assert "-k cuda tests/test_quantize.py tests/test_optim_8bit.py" in line["quant"]
    assert not (tmp_path / "out").exists()  # a plan: nothing run, nothing written


@pytest.fixture(scope="module")
def device_python(tmp_path_factory):
    """A Python like the device's: this environment's packages (torch, transformers, pytest) through
    one .pth line naming its site-packages, which adds that folder to sys.path without running the
    .pth files inside it: adept_ext's editable-install finder among them, so adept_ext is not
    importable. The compiled extension is where `build_ext --inplace` puts it on the device: in the
    source tree's adept_ext/ (an editable build puts it there too)."""
    venv = tmp_path_factory.mktemp("device-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    with open(os.path.join(site, "packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, "-c", "import torch, adept_ext"], cwd=venv, env=env, capture_output=True, text=True)
    assert "No module named 'adept_ext'" in proc.stderr, "the emulation has adept_ext installed: " + proc.stderr
    return python


def test_every_step_imports_and_parses_its_arguments_as_on_the_device(tmp_path, device_python):
    # setup.py refuses ADEPT_EXT_CUDA=1 where CUDA kernels cannot be built: emulate the build this machine makes.
    cuda = "1" if adept_ext.compiled_cuda_arch_list() else "0"
    proc = run_script(tmp_path, EMULATE="1", PYTHON=device_python, ADEPT_EXT_CUDA=cuda)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr
    summary = summary_of(tmp_path)
    assert summary["ok"] and {n: s["status"] for n, s in summary["steps"].items()} == dict.fromkeys(ALL, "ok")
    assert summary["machine"]["executable"] == device_python
    assert summary["machine"]["adept_ext"] == os.path.join(ROOT, "adept_ext", "__init__.py")
    logs = tmp_path / "work" / "logs"
    for name in ALL:
        if name.startswith("bench_"):
            assert "imports ok: adept_ext from " + os.path.join(ROOT, "adept_ext") in (logs / f"{name}.log").read_text()
    for name in ("tests", "memcheck", "racecheck", "quant"):  # each selects tests (on a GPU also their [cuda] cases)
        assert re.search(r"^\d+/\d+ tests collected", (logs / f"{name}.log").read_text(), flags=re.M), name
    quant = (logs / "quant.log").read_text()  # bitsandbytes' [cuda] cases only, each module's
    assert re.search(r"^bitsandbytes [\d.]+ from ", quant, flags=re.M)
    assert "test_quantize.py::test_hold_computes_with_the_dequantized_weights_and_release_restores_them[cuda]" in quant
    assert "test_optim_8bit.py::test_steps_follow_adamw_with_8bit_moments[cuda-adamw_8bit]" in quant
    assert "[cpu" not in quant
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu-check-all.json", "gpu-check-all.tar.gz"]
    with tarfile.open(tmp_path / "out" / "gpu-check-all.tar.gz") as tar:
        assert {"./summary.json", "./machine.json", "./steps.tsv", "./logs/tests.log"} <= set(tar.getnames())


def test_spent_budget_fails_loudly(tmp_path):
    proc = run_script(tmp_path, EMULATE="1", BUDGET_S="0")
    assert proc.returncode == 1
    assert "FAILED: build (skipped)" in proc.stdout
    assert summary_of(tmp_path)["failed_steps"] == ["build"]


def test_steps_selects_and_rejects_unknown_names(tmp_path):
    proc = run_script(tmp_path, EMULATE="1", CALL="3", STEPS="peers", WHEELS=str(tmp_path / "no-wheels"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = summary_of(tmp_path, "call3")["steps"]
    assert {n: s["status"] for n, s in steps.items()} == {n: "ok" if n == "peers" else "not requested" for n in CALL3}
    assert "the peers are not measured" in (tmp_path / "work" / "logs" / "peers.log").read_text()
    assert run_script(tmp_path, STEPS="bulid").returncode == 2
    assert run_script(tmp_path, CALL="1", STEPS="peers").returncode == 2  # a step of the other call
    assert run_script(tmp_path, CALL="4").returncode == 2


def test_quant_fails_saying_so_without_bitsandbytes(tmp_path):
    """No bitsandbytes where the device's Python looks (a wheel folder without it): the quant step fails
    and its log says what to carry, rather than its tests being skipped."""
    shadow = tmp_path / "shadow" / "bitsandbytes"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('planted: no bitsandbytes here')\n")
    proc = run_script(tmp_path, EMULATE="1", CALL="3", STEPS="quant", PYTHONPATH=str(tmp_path / "shadow"))
    assert proc.returncode == 1 and "FAILED: quant (failed)" in proc.stdout, proc.stdout + proc.stderr
    log = (tmp_path / "work" / "logs" / "quant.log").read_text()
    assert "quant: bitsandbytes is not importable (planted: no bitsandbytes here)" in log
    assert "put its wheel in the wheel folder" in log and "tests collected" not in log
    assert summary_of(tmp_path, "call3")["failed_steps"] == ["quant"]


def python_that_sees_a_gpu(bin_dir):
    """A python for the script's real path (no EMULATE): its check for a GPU passes, all else is this Python."""
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *cuda.is_available*) exit 0 ;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_a_sanitizer_that_refuses_the_gpu_is_unsupported_not_failed(tmp_path):
    """The real path, with a Python that sees a GPU and a compute-sanitizer that refuses it."""
    bin_dir = tmp_path / "bin"
    python = python_that_sees_a_gpu(bin_dir)
    (bin_dir / "compute-sanitizer").write_text(
        "#!/bin/sh\necho '========= Error: Target application terminated before first instrumented API call'\n"
        "exit 255\n")
    (bin_dir / "compute-sanitizer").chmod(0o755)
    proc = run_script(tmp_path, CALL="2", STEPS="memcheck", PYTHON=python, PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memcheck: UNSUPPORTED here, nothing checked" in proc.stdout
    summary = summary_of(tmp_path, "call2")
    assert {n: s["status"] for n, s in summary["steps"].items()} == {
        n: "unsupported" if n == "memcheck" else "not requested" for n in CALL2}


HANG_PLUGIN = """
import time

import pytest

HANGS = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items[:] = [item for item in items if "test_cuda_arch.py" in item.nodeid][:3]
    HANGS.append(items[2].nodeid)


@pytest.hookimpl(trylast=True)  # after pytest -v has written the test's id
def pytest_runtest_logstart(nodeid):
    if nodeid in HANGS:
        time.sleep(600)
"""


def test_a_pytest_step_over_its_limit_still_reports_the_tests_that_ran_and_the_one_that_hung(tmp_path):
    """The real tests step, its third test hanging (a pytest plugin), its limit the budget's 30 s: stopped
    with SIGINT, pytest writes its junit file, and the summary counts the two tests that ran and names the
    third."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "hang_third.py").write_text(HANG_PLUGIN)
    proc = run_script(tmp_path, CALL="1", STEPS="tests", BUDGET_S="30", PYTHON=python_that_sees_a_gpu(tmp_path / "bin"),
                      PYTHONPATH=str(tmp_path / "plugins"), PYTEST_ADDOPTS="-p hang_third")
    hung = "tests/test_cuda_arch.py::test_choose_builds_for_the_visible_gpus_plus_ptx[]"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAILED: tests (timeout; 2 tests ran, stopped in {hung})" in proc.stdout
    tests = summary_of(tmp_path, "call1")["steps"]["tests"]
    assert tests["status"] == "timeout" and tests["pytest"]["result"].startswith("2 passed, 392 deselected in ")
    assert {k: v for k, v in tests["pytest"].items() if k != "result"} == {
        "ran": 2, "outcomes": {"passed": 2}, "failed_ids": [], "unfinished": hung}
    assert summary_of(tmp_path, "call1")["tests"]["passed"] == 2  # pytest's junit file, written when interrupted


def write_run(tmp_path, steps, logs=(), bench=()):
    (tmp_path / "logs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "steps.tsv").write_text("".join(f"{n}\t{s}\t{rc}\t10\t{n}.log\n" for n, s, rc in steps))
    for name, text in dict(logs).items():
        (tmp_path / "logs" / f"{name}.log").write_text(text)
    for name, result in dict(bench).items():
        (tmp_path / "bench" / f"{name}.json").write_text(json.dumps(result))


def test_summary_reports_a_failed_step_with_its_log_and_the_sanitizer_counts(tmp_path):
    lr = {"lr": {"step_overhead": 0.013, "recompute_autocast_speedup_vs_fp32": 3.8}}
    write_run(tmp_path, [("build", "ok", 0), ("memcheck", "failed", 99)],
              logs={"memcheck": "========= Invalid __shared__ read of size 12 bytes\n1 failed, 20 passed in 50s\n"
                                "========= ERROR SUMMARY: 19 errors\n"},
              bench={"lr_large": lr})
    assert gpu_summary.main([str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed_steps"] == ["memcheck"] and not summary["ok"]
    assert summary["memcheck"]["errors"] == 19 and summary["memcheck"]["pytest"] == "1 failed, 20 passed in 50s"
    assert summary["steps"]["memcheck"]["log_tail"][0].startswith("========= Invalid")
    assert summary["goals"]["7_recompute"]["met"] is True and summary["goals"]["8_step_overhead"]["met"] is False
    assert summary["goals"]["3_linear_ce"]["met"] is None  # not measured
    assert summary["bench"]["lr_large"] == lr


@pytest.mark.parametrize("line, rc", [("========= Error: Target application terminated before first instrumented "
                                       "API call", 255),
                                      ("========= Error: Device not supported", 1),
                                      ("========= compute-sanitizer not found (PATH)", 127)])
def test_a_sanitizer_that_cannot_check_here_is_unsupported_not_failed(tmp_path, line, rc):
    write_run(tmp_path, [("tests", "ok", 0), ("memcheck", "failed", rc), ("racecheck", "ok", 0)],
              logs={"memcheck": f"========= COMPUTE-SANITIZER\n{line}\n",
                    "racecheck": "3 passed in 9s\n========= RACECHECK SUMMARY: 0 hazards displayed\n"})
    assert gpu_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["steps"]["memcheck"]["status"] == "unsupported"
    assert summary["unsupported_steps"] == {"memcheck": line} and summary["steps"]["racecheck"]["status"] == "ok"


def test_errors_found_are_failures_whatever_else_the_sanitizer_says(tmp_path):
    write_run(tmp_path, [("memcheck", "failed", 99)],
              logs={"memcheck": "========= Error: Device not supported for some API\n"
                                "========= ERROR SUMMARY: 2 errors\n"})
    assert gpu_summary.main([str(tmp_path)]) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["failed_steps"] == ["memcheck"]


def test_summary_reads_configurations_that_recorded_an_error(tmp_path):
    error = {"error": "RuntimeError: exit code -9"}
    trainer = {"tokens_per_s": 1000.0, "peak_memory_mb": 9000.0, "tokens_per_s_vs_trainer": 1.0,
               "peak_memory_vs_trainer": 1.0}
    forward_backward = {"n": 8192, "h": 2048, "v": 128256,
                        "providers": {"adept_ext": {"s": 0.1, "peak_mem_mb": 500.0}, "liger_fused_linear_ce": error}}
    write_run(tmp_path, [("bench_train_step_large", "ok", 0), ("bench_linear_ce_large", "ok", 0)], bench={
        "train_step_large": {"train_step": {"methods": {"full": {"adept_ext": error, "trainer": trainer,
                                                                 "trainer_liger": error}}}},
        "linear_ce_large": {"linear_ce": {"providers": {"adept_ext": {"s": 0.01, "peak_mem_mb": 100.0},
                                                        "cut_cross_entropy": error},
                                          "peers_installed": ["cut_cross_entropy"],
                                          "forward_backward": {"llama-3.2-1b": forward_backward}}},
        "probe_large": {"probe": ["not", "the", "expected", "shape"]}})
    assert gpu_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    goals = {k: g["met"] for k, g in summary["goals"].items()}
    assert goals["26_train_step"] is False and goals["33_train_step"] is None  # ours failed; Liger did not run
    assert goals["33_linear_ce_fwd_bwd"] is None and goals["3_linear_ce"] is False  # no GEMM fraction: not met
    assert summary["figures"]["linear_ce"]["forward"]["cut_cross_entropy"] == error
    assert summary["figures"]["probe"]["unreadable"].startswith("AttributeError")


def test_summary_counts_the_quant_step_s_tests(tmp_path):
    write_run(tmp_path, [("quant", "failed", 1)])
    (tmp_path / "logs" / "quant.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.test_quantize" name="test_hold[cuda]"><failure message="x"/></testcase>'
        '</testsuite></testsuites>')
    assert gpu_summary.main([str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quant_tests"]["passed"] == 3 and summary["quant_tests"]["failed_ids"] == [
        "tests.test_quantize::test_hold[cuda]"]
    assert summary["tests"] is None  # the tests step's count is its own


@pytest.mark.parametrize("full_table", [False, True])
def test_train_step_large_fits_an_h100_unless_the_full_table_is_asked_for(monkeypatch, full_table):
    """--size large measures only the configurations with checkpointing (an 80 GB H100), their ratios to
    the Trainer's checkpointed step, and the summary judges the goal it can: ours against Liger's, both
    checkpointed; --full-table (an H200) measures every configuration."""
    from types import SimpleNamespace

    from bench import train_step

    measured = []

    def fake_measure(config, size, device_name, steps=None):  # ours the fastest and smallest; the Trainer twice ours
        measured.append(config)
        ours = config[1].startswith("adept_ext")
        return [1.0] * 4, 100.0 if ours else 200.0, 10.0

    monkeypatch.setattr(train_step, "in_fresh_process", fake_measure)
    monkeypatch.setattr(train_step, "liger_installed", lambda: True)
    results = train_step.run(SimpleNamespace(quick=False, size="large", full_table=full_table), torch.device("cpu"))
    figures, goals = gpu_summary.train_step(results)
    if full_table:
        assert len(measured) == 7 and figures["adept_ext"]["peak_memory_vs_trainer"] == 0.5
        assert goals == {"26_train_step": False, "33_train_step": True}  # checkpointed: 0.5x, not <= 0.4x
    else:
        assert {c[1] for c in measured} == {"adept_ext", "trainer", "trainer_liger", "adept_ext_hf_loss"}
        assert all(c[2] for c in measured) and set(figures) == {f"{c[1]}+checkpointing" for c in measured}
        assert figures["adept_ext+checkpointing"]["peak_memory_vs_trainer"] == 0.5
        assert goals == {"26_train_step": None, "33_train_step": True}


@pytest.mark.parametrize("text", ["", "{not json"])
def test_summary_survives_a_broken_file(tmp_path, text):
    write_run(tmp_path, [("build", "ok", 0)])
    (tmp_path / "machine.json").write_text(text)
    (tmp_path / "logs" / "tests.xml").write_text(text)
    assert gpu_summary.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["tests"]["unreadable"]
