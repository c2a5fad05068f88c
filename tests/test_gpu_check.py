"""tools/gpu_check.sh's logic without a GPU (DRY_RUN) and tools/gpu_summary.py's merge."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_summary  # noqa: E402

STEPS = ["build", "import", "tests", "memcheck", "racecheck", "bench_linear_ce_large", "bench_probe_large",
         "bench_importance_small", "bench_importance_large", "bench_projection_small", "bench_projection_large",
         "bench_lr_large", "bench_train_step_large"]


def run_script(out, **env):
    env = {**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1", **env}
    return subprocess.run(["bash", SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=300)


def test_syntax():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_run_plans_every_step_and_writes_one_summary(tmp_path):
    proc = run_script(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and list(summary["steps"]) == STEPS
    assert summary["machine"]["torch"]
    assert "--tool memcheck" in (tmp_path / "logs" / "memcheck.log").read_text()
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in (tmp_path / "logs" / "memcheck.log").read_text()


def test_spent_budget_fails_loudly(tmp_path):
    proc = run_script(tmp_path, BUDGET_S="0")
    assert proc.returncode == 1
    assert "FAILED: build (skipped)" in proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["failed_steps"] == ["build"]


def test_steps_selects_and_rejects_unknown_names(tmp_path):
    proc = run_script(tmp_path, STEPS="build bench_probe_large")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [n for n, s in steps.items() if s["status"] == "ok"] == ["build", "bench_probe_large"]
    assert run_script(tmp_path, STEPS="bulid").returncode == 2


def test_summary_reports_a_failed_step_with_its_log_and_the_sanitizer_counts(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "steps.tsv").write_text("build\tok\t0\t40\tbuild.log\nmemcheck\tfailed\t99\t80\tmemcheck.log\n")
    (tmp_path / "logs" / "memcheck.log").write_text(
        "========= Invalid __shared__ read of size 12 bytes\n1 failed, 20 passed in 50s\n"
        "========= ERROR SUMMARY: 19 errors\n")
    lr = {"lr": {"step_overhead": 0.013, "recompute_autocast_speedup_vs_fp32": 3.8}}
    (tmp_path / "bench" / "lr_large.json").write_text(json.dumps(lr))
    assert gpu_summary.main([str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed_steps"] == ["memcheck"] and not summary["ok"]
    assert summary["memcheck"]["errors"] == 19 and summary["memcheck"]["pytest"] == "1 failed, 20 passed in 50s"
    assert summary["steps"]["memcheck"]["log_tail"][0].startswith("========= Invalid")
    assert summary["goals"]["7_recompute"]["met"] is True and summary["goals"]["8_step_overhead"]["met"] is False
    assert summary["goals"]["3_linear_ce"]["met"] is None  # not measured
    assert summary["bench"]["lr_large"] == lr


@pytest.mark.parametrize("text", ["", "{not json"])
def test_summary_survives_a_broken_file(tmp_path, text):
    (tmp_path / "steps.tsv").write_text("build\tok\t0\t1\tbuild.log\n")
    (tmp_path / "machine.json").write_text(text)
    assert gpu_summary.main([str(tmp_path)]) == 0
