"""tools/bench: the shared harness (timing, peak memory, result rows and their CSV), the command
line, and docs/benchmarks.md's tables, which must be what the generator renders from the CSV."""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench  # noqa: E402
from bench import common, linear_ce, probe, tables  # noqa: E402

CPU = torch.device("cpu")


def test_page_is_what_the_generator_renders_from_the_committed_csv():
    with open(tables.PAGE) as f:
        page = f.read()
    assert tables.render_page(common.read_csv(tables.CSV), page) == page, "run: python tools/bench.py tables"


def test_tables_check_fails_on_a_stale_page_and_on_a_table_the_csv_cannot_fill(tmp_path):
    with open(tables.PAGE) as f:
        page = f.read()
    stale = tmp_path / "page.md"
    stale.write_text(page.replace("| 40.08 |", "| 41.08 |"))
    assert tables.main(tables.CSV, str(stale), check=True) == 1
    rows = [r for r in common.read_csv(tables.CSV) if not r["shape"].endswith("k 64")]
    with pytest.raises(ValueError, match="k = 64"):
        tables.render_page(rows, page)
    wrong_unit = [{**r, "unit": "s"} if r["benchmark"] == "importance" else r for r in common.read_csv(tables.CSV)]
    with pytest.raises(ValueError, match="unit"):
        tables.render_page(wrong_unit, page)


def test_the_committed_csv_is_cpu_figures_with_their_provenance():
    """Every committed row is a CPU figure (no GPU figure of the current code exists), either a run
    of tools/bench.py with its command or a transcription of an earlier README table."""
    rows = common.read_csv(tables.CSV)
    assert rows and all(r["device"] == "cpu" and r["source"] in ("transcribed from README", "tools/bench.py")
                        for r in rows)
    assert all(r["command"].startswith("python tools/bench.py") for r in rows if r["source"] == "tools/bench.py")
    assert all(len(r["commit"]) == 7 and r["date"].startswith("2026-") and r["command"] for r in rows)
    assert all(float(r["value"]) == float(r["value"]) for r in rows)  # every value a number


def test_median_time_warms_up_and_returns_the_median():
    calls, sleeps = [], iter([0.0, 0.0, 0.05, 0.001, 0.02])

    def fn():
        calls.append(1)
        time.sleep(next(sleeps))
        return "out"

    t = common.median_time(fn, CPU, repeats=3, warmup=2)
    assert len(calls) == 5 and 0.015 < t < 0.045  # the median of 0.05, 0.001, 0.02 s
    out, seconds = common.timed(lambda: time.sleep(0.01) or "out", CPU)
    assert out == "out" and seconds >= 0.01


def test_interleaved_median_times_calls_in_turn_after_the_warmup():
    calls, sleeps = [], {"a": iter([0.0, 0.03, 0.001, 0.02]), "b": iter([0.0, 0.0, 0.0, 0.01])}

    def fn(name):
        calls.append(name)
        time.sleep(next(sleeps[name]))

    t = common.interleaved_median_times({"a": functools.partial(fn, "a"), "b": functools.partial(fn, "b")}, CPU,
                                        repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert 0.015 < t["a"] < 0.03 and t["b"] < 0.01  # the medians of 0.03, 0.001, 0.02 s and 0, 0, 0.01 s


def allocate_64mb(setup_only=False, state=None):
    """For peak_mb: the setup holds nothing; the call fills 64 MB."""
    if setup_only:
        return None
    return float(torch.ones(2**24).sum())


def test_peak_memory_on_the_cpu_in_this_process_and_in_a_fresh_one():
    assert 60 < common.peak_mb(allocate_64mb, CPU) < 200
    assert common.peak_mb(lambda: None, CPU) < 10
    assert 60 < common.peak_mb(allocate_64mb, CPU, fresh=functools.partial(allocate_64mb)) < 200


def args_of(**kw):
    return argparse.Namespace(**{"size": "small", "quick": False, **kw})


def test_rows_round_trip_through_the_csv(tmp_path):
    path = tmp_path / "results" / "bench.csv"
    partial = [common.row("adept_ext", "time", 1.234567, "ms", dtype="float32", shape="3 tensors, 1.0M elements"),
               common.row("torch", "peak_extra_memory", 12, "MB")]
    first = common.run_rows("importance", partial, args_of(quick=True), CPU, ["importance", "--quick"],
                            commit="abc1234")
    second = common.run_rows("probe", partial[:1], args_of(), CPU, ["probe"], commit="abc1234")
    common.append_csv(path, first)
    common.append_csv(path, second)
    back = common.read_csv(path)
    assert back == first + second
    assert back[0]["value"] == "1.235" and back[1]["value"] == "12" and back[0]["size"] == "small --quick"
    assert back[0]["command"] == "python tools/bench.py importance --quick" and back[0]["source"] == "tools/bench.py"
    assert path.read_text().count("benchmark,provider") == 1
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        common.append_csv(other, first)


def test_every_benchmark_has_a_module_with_run_and_rows():
    import importlib

    assert len(bench.NAMES) == 13
    for name in bench.NAMES:
        module = importlib.import_module(f"bench.{name}")
        assert callable(module.run) and callable(module.rows), name


def test_rows_of_results_only_a_gpu_or_the_large_size_gives():
    lce = {"n": 8192, "h": 2048, "v": 128256, "dtype": "bfloat16", "gemm_s": 0.006, "gemm_tflops": 700.0,
           "peak_mem_gemm_mb": 2004.0, "providers": {
               "adept_ext": {"s": 0.008, "tflops": 500.0, "gemm_fraction": 0.8, "peak_mem_mb": 251.0,
                             "rel_diff_loss_sum": 1e-6, "time_vs_adept_ext": 1.0},
               "liger_fused_linear_ce": {"error": "TypeError: no"}, "cut_cross_entropy": {"skipped": "not installed"}},
           "forward_backward": {"llama-3.2-1b": {"n": 8192, "h": 2048, "v": 128256, "dtype": "bfloat16", "providers": {
               "torch": {"s": 0.05, "tflops": 200.0, "peak_mem_mb": 12000.0, "time_vs_torch": 1.0,
                         "peak_mem_vs_torch": 1.0, "rel_diff_loss_vs_torch": 0.0, "max_rel_diff_grads_vs_torch": 0.0},
               "liger_fused_linear_ce": {"error": "TypeError: no"},
               "cut_cross_entropy": {"skipped": "not installed"}}}}}
    rows = linear_ce.rows(lce)
    assert {r["provider"] for r in rows} == {"gemm_alone", "adept_ext", "torch"}
    assert {r["shape"] for r in rows if r["provider"] == "torch"} == {"forward+backward, N 8192 x H 2048 x V 128256"}
    large = {"model": "qwen3-0.6b-shape", "dtype": "bfloat16", "batches": 2, "batch_size": 8, "block_len": 512,
             "naive_s": 1.9, "fused_s": 2.0, "speedup_vs_naive": 0.95, "flop_ratio_bound": 1.59,
             "peak_mem_naive_mb": 100.0, "peak_mem_fused_mb": 50.0, "memory_fraction_of_naive": 0.5,
             "max_rel_diff_variant_losses": 1e-3}
    rows = probe.rows({"qwen3-0.6b-shape": large})
    assert {r["shape"] for r in rows} == {"qwen3-0.6b-shape, 2 batches x 8x512"} and len(rows) == 8


def test_train_step_rows_and_configurations():
    """Every method against the Trainer, with and without checkpointing (Liger's only when
    installed), plus our loop on HF's loss; four figures per measured configuration."""
    from bench import train_step

    configs = train_step.configurations(liger=False)
    assert len(configs) == len(set(configs)) == 15 and ("full", "adept_ext_hf_loss", False) in configs
    assert {("full", "adept_ext_compile", False), ("full", "adept_ext_compile", True)} <= set(configs)
    large = train_step.configurations(liger=False, size="large")  # the GPU check's budget: full, no compilation
    assert {m for m, _, _ in large} == {"full"} and len(large) == 5
    assert {loop for _, loop, _ in train_step.configurations(liger=True)} >= {"trainer_liger"}
    results = {"model": "smollm2-135m-shape", "batch": 4, "seq": 2048, "dtype": "float32", "methods": {
        "full": {"adept_ext": {"tokens_per_s": 90.0, "peak_memory_mb": 500.0, "tokens_per_s_vs_trainer": 0.9,
                               "peak_memory_vs_trainer": 0.5},
                 "trainer": {"tokens_per_s": 100.0, "peak_memory_mb": 1000.0, "tokens_per_s_vs_trainer": 1.0,
                             "peak_memory_vs_trainer": 1.0},
                 "trainer+checkpointing": {"error": "exit code -9"}}}}  # killed for memory: no row
    rows = train_step.rows(results)
    assert len(rows) == 8 and {r["shape"] for r in rows} == {"full: smollm2-135m-shape, 4 x 2048 tokens"}
    assert {(r["provider"], r["metric"]): r["value"] for r in rows}[("adept_ext", "peak_memory_vs_trainer")] == 0.5


def test_our_train_step_runs_a_step_of_the_runner_s_loop():
    """`our_steps` drives `training.train_steps` with the options it reads (a missing one, as `optim`
    once was, failed every adept_ext configuration of the benchmark): one step on a tiny Llama."""
    from bench import train_step
    from tiny_models import tiny_model

    model = tiny_model("llama", layers=2)
    batch = common.random_batches(model.config.vocab_size, 1, 2, 16, torch.device("cpu"))[0]
    task = train_step.prepared_task("lora", model, torch.device("cpu"), 1)
    times = train_step.our_steps(task, batch, torch.device("cpu"), False, 1, "auto", False)
    assert len(times) == 1 and times[0] > 0


def test_a_quick_run_appends_its_rows_to_the_csv(tmp_path):
    path = tmp_path / "rows.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "importance", "--quick",
                           "--csv", str(path), "--json", str(tmp_path / "bench.json")],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = common.read_csv(path)
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"} and len(rows) == 18
    assert all(r["benchmark"] == "importance" and r["size"] == "small --quick" and r["device"] == "cpu"
               and r["source"] == "tools/bench.py" and r["date"] for r in rows)
    times = {(r["dtype"], r["provider"]): float(r["value"]) for r in rows if r["metric"] == "time"}
    assert len(times) == 8 and all(t > 0 for t in times.values())
    assert set(json.loads((tmp_path / "bench.json").read_text())) == {"machine", "importance"}
    assert path.read_text().splitlines()[0] == ",".join(common.CSV_FIELDS)


def test_linear_ce_runs_the_forward_and_the_training_rows_at_a_small_size(monkeypatch):
    """Both parts of `bench linear_ce` at a tiny shape on the CPU: the peers are recorded as not run
    (not installed here, or GPU only), ours and plain torch are measured and agree."""
    monkeypatch.setattr(linear_ce, "LCE_SHAPES", {"small": (96, 32, 3000, torch.float32)})
    monkeypatch.setattr(linear_ce, "TRAIN_SHAPES", {"small": {"tiny": (256, 64, 8192, torch.float32)}})
    results = linear_ce.run(args_of(), CPU)
    fb = results["forward_backward"]["tiny"]
    assert (fb["n"], fb["h"], fb["v"], fb["repeats"]) == (256, 64, 8192, 5)
    assert set(results["providers"]) == {"torch", "adept_ext", *linear_ce.PEERS}
    assert set(fb["providers"]) == {"torch", "adept_ext", "adept_ext_per_row", *linear_ce.PEERS}
    for providers in (results["providers"], fb["providers"]):
        assert all(set(providers[peer]) == {"skipped"} for peer in linear_ce.PEERS)
    assert fb["providers"]["adept_ext_per_row"]["max_rel_diff_grads_vs_torch"] < 1e-4
    ours, torch_ = fb["providers"]["adept_ext"], fb["providers"]["torch"]
    assert torch_["time_vs_torch"] == torch_["peak_mem_vs_torch"] == 1 and torch_["peak_mem_mb"] > 1
    assert ours["s"] > 0 and ours["tflops"] > 0 and ours["peak_mem_mb"] >= 0
    assert ours["time_vs_torch"] == ours["s"] / torch_["s"]
    assert ours["rel_diff_loss_vs_torch"] < 1e-5 and ours["max_rel_diff_grads_vs_torch"] < 1e-4
    metrics = {(r["provider"], r["metric"]) for r in linear_ce.rows(results)
               if r["shape"] == "forward+backward, N 256 x H 64 x V 8192"}
    assert {("adept_ext", m) for m in ("time", "tflops", "time_vs_torch", "peak_extra_memory", "peak_memory_vs_torch",
                                       "rel_diff_loss_vs_torch", "max_rel_diff_grads_vs_torch")} <= metrics


PEER_STUBS = {  # the peers' entry points, written with torch: what the benchmark calls, without Triton
    "cut_cross_entropy/__init__.py": (
        "import torch\n\n\ndef linear_cross_entropy(e, c, targets, reduction):\n"
        "    return torch.nn.functional.cross_entropy(e @ c.T, targets, reduction=reduction)\n"),
    "liger_kernel/__init__.py": "", "liger_kernel/transformers/__init__.py": "",
    "liger_kernel/transformers/functional.py": (
        "import torch\n\n\ndef liger_fused_linear_cross_entropy(input, weight, target, reduction):\n"
        "    return torch.nn.functional.cross_entropy(input @ weight.T, target, reduction=reduction), None\n"),
}


def test_linear_ce_training_rows_of_peers_stubbed_failing_and_not_installed(tmp_path, monkeypatch):
    for path, text in PEER_STUBS.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))  # also the path of the fresh processes measuring memory
    peers, skipped = linear_ce.lce_peers(torch.device("cuda"))  # only imports: no GPU needed
    assert set(peers) == set(linear_ce.PEERS) and not skipped
    assert linear_ce.lce_peers(CPU) == ({}, {name: "GPU only (a Triton kernel)" for name in linear_ce.PEERS})

    def broken(h, w, t, reduction):
        raise TypeError("an unexpected keyword argument")

    fb = linear_ce.forward_backward("tiny", (256, 64, 8192, torch.float32),
                                    {"torch": linear_ce.torch_loss, **peers, "broken": broken}, {*peers, "broken"},
                                    {"absent": "not installed"}, CPU, repeats=5)
    assert fb["providers"]["broken"] == {"error": "TypeError: an unexpected keyword argument"}
    assert fb["providers"]["absent"] == {"skipped": "not installed"}
    for name in peers:
        r = fb["providers"][name]
        assert r["s"] > 0 and r["peak_mem_vs_torch"] > 0.5  # the stubs are plain torch
        assert r["rel_diff_loss_vs_torch"] < 1e-6 and r["max_rel_diff_grads_vs_torch"] < 1e-6

    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)  # importing it: ImportError
    peers, skipped = linear_ce.lce_peers(torch.device("cuda"))
    assert set(peers) == {"cut_cross_entropy"} and skipped["liger_fused_linear_ce"].startswith("not installed")


def tiny_llama(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


@pytest.mark.parametrize("other_lr", [1e-3, 2e-3])
def test_lr_steps_two_optimizers_on_the_same_gradients_and_reports_their_largest_difference(other_lr):
    """bench lr's comparison: AdamW and GroupedAdamW on the gradients of one backward train the
    same weights (difference 0 on the CPU); a planted different optimizer (another lr) shows."""
    import copy

    from bench import lr

    from adept_ext.optim import GroupedAdamW

    model = tiny_llama()
    other = copy.deepcopy(model)
    steppers = {"adamw": (model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)),
                "grouped": (other, GroupedAdamW(other.parameters(), lr=other_lr, weight_decay=0.01))}
    batches = common.random_batches(128, 4, 2, 16, CPU)
    times = lr.same_gradient_steps(model, steppers, batches, CPU, warmup=1)
    assert {name: len(t) for name, t in times.items()} == {"forward_backward": 3, "adamw": 3, "grouped": 3}
    diff = lr.max_abs_diff(model, other)
    assert diff == 0 if other_lr == 1e-3 else diff > 1e-4
