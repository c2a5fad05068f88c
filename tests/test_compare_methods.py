"""tools/compare_methods.py's bookkeeping (no training): the options of each run, the resolved
configuration its row records, which finished runs `--collect` tabulates, the benchmark columns."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compare_methods  # noqa: E402

from adept_ext.train import config_from  # noqa: E402
from adept_ext.training import result_options  # noqa: E402

ARC = {"adept_arc_easy": {"acc": {"base": 0.40, "final": 0.38, "delta": -0.02, "stderr": 0.03, "beyond_2se": False,
                                  "paired": {"p_value": 0.0041, "significant": True}},
                          "acc_norm": {"base": 0.41, "final": 0.43, "delta": 0.02, "stderr": None,
                                       "beyond_2se": None}}}


def wanted(method="lora", out="runs/x", extra=None, **options):
    """result_options of the run compare_methods would make, with `options` changed."""
    return result_options(config_from({**compare_methods.run_options(method, 100, 3e-4, 0, 4, extra or {}, out),
                                       **options}))


def write_report(out: Path, config, **extra):
    """A finished run's report.json in `out` with the keys a row reads, recorded under `config`."""
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": config, "forgetting_general_delta": 0.01, "gain_domain_delta": 0.4, "trainable_fraction": 0.1,
              "wall_seconds": 60.0, "layers": [3], "base": {}, "final": {}, **extra}
    (out / "report.json").write_text(json.dumps(report))


def test_run_options_convert_set_texts_to_each_options_type():
    options = compare_methods.run_options("adept", 100, 1e-3, 1, 4, {"probe_blocks": "8", "packing": "false",
                                                                      "mix_general": "0.1"}, Path("runs/a"))
    assert options["probe_blocks"] == 8 and options["packing"] is False and options["mix_general"] == 0.1
    assert options["warmup_steps"] == 10 and options["out"] == "runs/a" and options["lr"] == 1e-3
    assert compare_methods.run_options("adept", 100, 1e-3, 1, 4, {"packing": "true"}, "x")["packing"] is True


def test_collect_takes_a_report_only_under_the_configuration_it_would_run(tmp_path):
    out = tmp_path / "lora"
    collect = lambda: compare_methods.run_one("lora", 100, 3e-4, 0, 4, {}, out, collect=True)  # noqa: E731
    write_report(out, wanted(out=str(out)), benchmarks={"difference": ARC})
    row = collect()
    assert row["config"] == wanted() and row["config"]["lora_rank"] == 8 and row["benchmarks"] == ARC
    assert row["general_delta"] == 0.01 and row["domain_delta"] == -0.4
    write_report(out, {**wanted(), "lora_rank": 16})  # run while the default rank was 16
    assert collect() is None
    write_report(out, {**wanted(), "max_length": 256})  # a runner default changed
    assert collect() is None
    older = wanted()
    del older["truncation_mode"]  # a report older than the option: what ran is its default
    write_report(out, older)
    assert collect()["config"] == wanted()
    keep_start = compare_methods.run_one("lora", 100, 3e-4, 0, 4, {"truncation_mode": "keep_start"}, out,
                                         collect=True)
    assert keep_start is None
    # where it wrote, checkpointed, logged or tracked does not change what a run computes
    write_report(out, {**wanted(out="elsewhere", save_every=5, logging_steps=3, report_to="tensorboard"),
                       "out": "elsewhere", "save_every": 5, "report_to": "tensorboard"})
    assert collect()["config"] == wanted() and collect()["benchmarks"] == {}


def test_benchmark_options_are_part_of_the_configuration():
    arc = wanted(extra={"benchmarks": "adept_arc_easy", "limit": "20"})
    assert (arc["benchmarks"], arc["limit"]) == ("adept_arc_easy", 20) and arc != wanted()


def test_collect_tabulates_only_the_runs_of_this_configuration(tmp_path, capsys):
    argv = ["--methods", "lora,full", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "compare"),
            "--collect"]
    lora = tmp_path / "runs" / "lora-lr0.0003-s0-k4-n100"
    full = tmp_path / "runs" / "full-lr0.0003-s0-k4-n100"
    write_report(lora, wanted(out=str(lora)))
    write_report(full, {**wanted("full"), "lr": 1e-3})
    compare_methods.main(argv)
    rows = json.loads((tmp_path / "compare.json").read_text())["methods"]
    assert [r["method"] for r in rows] == ["lora"] and rows[0]["config"] == wanted()
    assert f"{full}: not tabulated" in capsys.readouterr().out


def test_benchmark_columns_give_final_delta_and_stderr(tmp_path):
    args = SimpleNamespace(results=str(tmp_path / "compare"), steps=100, lr=3e-4, seed=0, k=4,
                           extra={"benchmarks": "adept_arc_easy"})
    row = {"method": "lora", "general_delta": 0.01, "domain_delta": -0.4, "trainable_fraction": 0.1,
           "wall_seconds": 60.0, "layers": [3], "tokens_per_second": 130.5, "peak_memory_mb": 2261,
           "final": {"kl_to_base": 0.0123}}
    compare_methods.write_results(args, [{**row, "benchmarks": ARC}, {**row, "method": "full", "benchmarks": {},
                                                                      "tokens_per_second": None, "final": {}}])
    table = (tmp_path / "compare.md").read_text()
    assert "| adept_arc_easy acc | adept_arc_easy acc_norm |" in table
    assert ("| lora | +0.0100 | -0.4000 | 0.0123 | 10.0% | 60.0 | 130.5 | 2261 | [3] | "
            "0.3800 (-0.0200, se 0.0300, paired p 0.0041 *) | 0.4300 (+0.0200) |") in table
    assert "| full | +0.0100 | -0.4000 | – | 10.0% | 60.0 | – | 2261 | [3] | – | – |" in table
    compare_methods.write_results(args, [row])  # no benchmark: the columns of before
    assert "acc" not in (tmp_path / "compare.md").read_text()


def test_drift_correlation_pairs_each_runs_kl_with_its_changes(tmp_path):
    import drift_correlation

    def result(seed, rows):
        return {"budget": {"seed": seed}, "methods": [
            {"method": m, "general_delta": g, "domain_delta": -0.3, "final": {"kl_to_base": kl},
             "benchmarks": {"adept_general": {"acc": {"delta": b}}}} for m, kl, g, b in rows]}

    files = []
    for seed, rows in ((0, [("lora", 0.01, 0.00, 0.0), ("full", 0.20, 0.09, -0.03)]),
                       (1, [("lora", 0.02, 0.01, -0.01), ("full", 0.15, 0.07, -0.02), ("old", None, 0.0, 0.0)])):
        files.append(tmp_path / f"s{seed}.json")
        files[-1].write_text(json.dumps(result(seed, rows)))
    drift_correlation.main([*map(str, files), "--out", str(tmp_path / "drift")])
    written = json.loads((tmp_path / "drift.json").read_text())
    assert [(r["method"], r["seed"]) for r in written["runs"]] == [("lora", 0), ("full", 0), ("lora", 1), ("full", 1)]
    general = written["correlation"]["general_delta"]
    assert general["n"] == 4 and general["spearman_rho"] == 1.0
    assert written["correlation"]["adept_general_acc_delta"]["spearman_rho"] == -1.0
    assert "| full | 0 | 0.2000 | +0.0900 |" in (tmp_path / "drift.md").read_text()


def test_merge_front_averages_seeds_and_names_the_methods_it_matches(tmp_path):
    import merge_front

    runs = []
    for seed, shift in ((0, 0.0), (1, 0.02)):
        front = [{"alpha": a, "general_delta": 0.1 * a + shift, "domain_delta": -0.7 * a} for a in (0.0, 0.5, 1.0)]
        run = tmp_path / f"run{seed}"
        run.mkdir()
        (run / "report.json").write_text(json.dumps({"method": "full", "merge_back": {"front": front, "alpha": 0.5}}))
        runs.append(run)
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"methods": [{"method": "lora", "general_delta": 0.055, "domain_delta": -0.34},
                                               {"method": "adept", "general_delta": 0.0, "domain_delta": -0.3}]}))
    merge_front.main(["--runs", ",".join(map(str, runs)), "--results", str(results), "--methods", "adept,lora",
                      "--out", str(tmp_path / "front")])
    written = json.loads((tmp_path / "front.json").read_text())
    half = next(p for p in written["front"] if p["alpha"] == 0.5)
    assert half["general_delta"] == pytest.approx(0.06) and half["general_spread"] == pytest.approx(0.01)
    assert half["at_least_as_good_as"] == ["lora"]  # forgets 0.06 ± 0.01 vs adept's 0.0: beyond the spread
    assert next(p for p in written["front"] if p["alpha"] == 0.0)["at_least_as_good_as"] == []  # gains nothing
    assert (tmp_path / "front.png").exists() and written["auto_alpha"] == [0.5, 0.5]
