"""tools/frontier.py's bookkeeping (no training): which earlier results it may reuse, the
dominance verdicts it reports, and the files it writes."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compare_methods  # noqa: E402
import frontier  # noqa: E402

from adept_ext.train import config_from  # noqa: E402
from adept_ext.training import result_options  # noqa: E402


def _wanted(tmp_path, label="lora", lr=3e-4, seed=0, extra=None, **options):
    """The resolved configuration the frontier would run for `label` at `lr` and `seed` (with `extra`
    as --set and `options` changed afterwards: another default, say)."""
    args = SimpleNamespace(steps=100, k=4, out=str(tmp_path / "runs"))
    variant = frontier.parse_method(label)
    config = frontier.wanted_config(args, variant, lr, seed, {**frontier.PUBLISHED_OPTIONS, **(extra or {})})
    return {**config, **options}


def _row(method, config=None, domain=-0.4):
    row = {"method": method, "general_delta": -0.01, "domain_delta": domain, "trainable_fraction": 0.1,
           "wall_seconds": 60.0, "layers": [1]}
    return row if config is None else {**row, "config": config}


def _comparison(path, rows):
    path.write_text(json.dumps({"budget": {"steps": 100}, "methods": rows}))
    return str(path)


def _frontier(tmp_path, monkeypatch, methods="lora", lrs="3e-4", seeds="0", *more, fresh=True):
    """frontier.main on these points with --reuse tmp_path/compare*.json and --results tmp_path/frontier
    (removed first when `fresh`: no earlier frontier), a run stubbed (its row carries the configuration
    it would run): (run directory, lr, seed) of the points it ran, and the points it wrote."""
    ran = []
    if fresh:
        (tmp_path / "frontier.json").unlink(missing_ok=True)

    def run_one(method, steps, lr, seed, k, extra, out, collect=False):
        if collect:
            return compare_methods.run_one(method, steps, lr, seed, k, extra, out, collect=True)
        ran.append((out.name, lr, seed))
        cfg = config_from(compare_methods.run_options(method, steps, lr, seed, k, extra, out))
        return _row(method, result_options(cfg), domain=-0.5)
    monkeypatch.setattr(frontier, "run_one", run_one)
    frontier.main(["--methods", methods, "--lrs", lrs, "--seeds", seeds, "--reuse", str(tmp_path / "compare*.json"),
                   "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "frontier"), *more])
    points = json.loads((tmp_path / "frontier.json").read_text())["points"] if not more else []
    return ran, points


def test_parse_method_labels_placements():
    assert frontier.parse_method("adept:placement=spread") == {
        "label": "adept spread", "method": "adept", "options": {"placement": "spread"}}
    assert frontier.parse_method("lora")["options"] == {}


def _point(label, lr, seed, general, domain):
    return {"label": label, "method": label.split()[0], "lr": lr, "seed": seed, "general_delta": general,
            "domain_delta": domain, "layers": [1], "source": "x"}


def test_dominance_needs_both_axes_on_every_seed():
    points = [_point("llama_pro", 3e-4, s, 0.0, -0.40) for s in (0, 1)]
    points += [_point("lora", 3e-4, s, 0.0, -0.40) for s in (0, 1)]
    points += [_point("adept spread", 3e-4, 0, -0.01, -0.41), _point("adept spread", 3e-4, 1, -0.01, -0.45)]
    points += [_point("adept", 3e-4, 0, -0.01, -0.41), _point("adept", 3e-4, 1, 0.01, -0.45)]  # forgets on seed 1
    points += [_point("adept depth", 3e-4, 0, -0.01, -0.41)]  # seed 1 not measured
    verdicts = {v["label"]: v for v in frontier.dominance(points, [3e-4], [0, 1])}
    assert verdicts["adept spread"]["dominates_all"]
    assert not verdicts["adept"]["dominates_all"] and verdicts["adept"]["lora"]["dominates_on_seeds"] == [0]
    assert not verdicts["adept depth"]["dominates_all"] and verdicts["adept depth"]["lora"]["measured_seeds"] == [0]


def test_writes_table_json_and_png(tmp_path):
    variants = [frontier.parse_method(m) for m in ("adept", "adept:placement=spread", "lora")]
    points = [_point(v["label"], lr, s, 0.01 * lr * 1e3, -0.4 - s / 10) for v in variants for lr in (3e-4, 1e-3)
              for s in (0, 1)]
    args = SimpleNamespace(results=str(tmp_path / "frontier"), steps=100, k=4)
    frontier.write_results(args, {"probe_blocks": "8"}, [3e-4, 1e-3], [0, 1], variants, points)
    table = (tmp_path / "frontier.md").read_text()
    assert "| adept spread | 0.0003 | +0.0030 / +0.0030 | -0.4000 / -0.5000 |" in table
    assert json.loads((tmp_path / "frontier.json").read_text())["budget"]["seeds"] == [0, 1]
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_reuses_a_comparison_row_only_under_the_configuration_it_would_run(tmp_path, monkeypatch, capsys):
    wanted = _wanted(tmp_path)
    path = _comparison(tmp_path / "compare-a.json", [_row("lora", wanted)])
    ran, points = _frontier(tmp_path, monkeypatch)
    assert ran == [] and points[0]["source"] == path and points[0]["config"] == wanted
    for changed in ({"lora_rank": 16},  # the method's default rank changed since the row was run
                    {"max_length": 256},  # a runner default changed
                    {"probe_blocks": 4}):  # run without the frontier's --set probe_blocks=8
        _comparison(tmp_path / "compare-a.json", [_row("lora", {**wanted, **changed})])
        assert _frontier(tmp_path, monkeypatch)[0] == [("lora-lr0.0003-s0-k4-n100", 3e-4, 0)], changed
    older = dict(wanted)
    del older["truncation_mode"]  # recorded before the option existed: what ran is its default
    _comparison(tmp_path / "compare-a.json", [_row("lora", older)])
    assert _frontier(tmp_path, monkeypatch)[0] == []
    older["truncation_mode"] = "keep_start"  # but not another value
    _comparison(tmp_path / "compare-a.json", [_row("lora", older)])
    assert len(_frontier(tmp_path, monkeypatch)[0]) == 1
    capsys.readouterr()
    _comparison(tmp_path / "compare-a.json", [_row("lora")])  # recorded before rows kept their configuration
    ran, points = _frontier(tmp_path, monkeypatch)
    assert len(ran) == 1 and points[0]["domain_delta"] == -0.5
    assert "not reused: 1 comparison row(s) and 0 earlier frontier point(s)" in capsys.readouterr().out


def test_options_that_do_not_change_results_do_not_prevent_reuse(tmp_path, monkeypatch):
    elsewhere = _wanted(tmp_path, extra={"save_every": "5", "report_to": "tensorboard", "logging_steps": "3",
                                         "out": str(tmp_path / "other")})
    assert elsewhere == _wanted(tmp_path)
    _comparison(tmp_path / "compare-a.json", [_row("lora", elsewhere)])
    assert _frontier(tmp_path, monkeypatch)[0] == []


def test_a_row_is_reused_for_any_label_of_its_configuration(tmp_path, monkeypatch):
    _comparison(tmp_path / "compare-a.json", [_row("adept", _wanted(tmp_path, "adept", placement="spread"))])
    ran, points = _frontier(tmp_path, monkeypatch, "adept;adept:placement=spread")
    assert [name for name, _, _ in ran] == ["adept-lr0.0003-s0-k4-n100"]
    assert [p["label"] for p in points] == ["adept", "adept spread"] and points[1]["domain_delta"] == -0.4
    ran, points = _frontier(tmp_path, monkeypatch, "adept:placement=uniform;adept:placement=uniform,k=4")
    assert len(ran) == 1 and len(points) == 2  # k = 4 is the frontier's --k: one run for both


def test_earlier_frontier_points_are_reused_only_under_their_configuration(tmp_path, monkeypatch, capsys):
    ran, _ = _frontier(tmp_path, monkeypatch, "adept", "3e-4", "0,1")  # run both seeds, write the frontier
    assert len(ran) == 2
    ran, points = _frontier(tmp_path, monkeypatch, "adept:placement=importance", "3e-4,1e-3", "0,1",  # the default
                            fresh=False)
    assert [(lr, seed) for _, lr, seed in ran] == [(1e-3, 0), (1e-3, 1)] and len(points) == 4
    data = json.loads((tmp_path / "frontier.json").read_text())
    data["points"][0]["config"]["k"] = 8  # recorded under another default
    del data["points"][1]["config"]  # recorded before points kept their configuration
    (tmp_path / "frontier.json").write_text(json.dumps(data))
    capsys.readouterr()
    ran, _ = _frontier(tmp_path, monkeypatch, "adept", "3e-4,1e-3", "0,1", fresh=False)
    assert [(lr, seed) for _, lr, seed in ran] == [(3e-4, 0), (3e-4, 1)]
    assert "0 comparison row(s) and 1 earlier frontier point(s)" in capsys.readouterr().out


def test_a_finished_run_directory_is_reused_only_under_its_configuration(tmp_path, monkeypatch):
    out = tmp_path / "runs" / "lora-lr0.0003-s0-k4-n100"
    out.mkdir(parents=True)
    report = {"forgetting_general_delta": 0.02, "gain_domain_delta": 0.3, "trainable_fraction": 0.1,
              "wall_seconds": 60.0, "layers": [1], "base": {}, "final": {}}
    (out / "report.json").write_text(json.dumps({**report, "config": _wanted(tmp_path)}))
    ran, points = _frontier(tmp_path, monkeypatch)
    assert ran == [] and points[0]["source"] == str(out) and points[0]["domain_delta"] == -0.3
    (out / "report.json").write_text(json.dumps({**report, "config": _wanted(tmp_path, lora_rank=16)}))
    assert _frontier(tmp_path, monkeypatch)[0] == [(out.name, 3e-4, 0)]
    spread = tmp_path / "runs" / "adept-placementspread-lr0.0003-s0-k4-n100"  # a variant: its options count
    spread.mkdir()
    (spread / "report.json").write_text(json.dumps({**report, "config": _wanted(tmp_path, "adept:placement=spread")}))
    assert _frontier(tmp_path, monkeypatch, "adept:placement=spread")[0] == []


def test_lanes_split_the_points_no_comparison_holds(tmp_path, monkeypatch):
    _comparison(tmp_path / "compare-a.json", [_row("lora", _wanted(tmp_path))])
    lanes = [_frontier(tmp_path, monkeypatch, "lora;full", "3e-4,1e-3", "0", "--shard", f"{i}/2")[0] for i in (0, 1)]
    assert sorted(lanes[0] + lanes[1]) == sorted([("full-lr0.0003-s0-k4-n100", 3e-4, 0),
                                                  ("lora-lr0.001-s0-k4-n100", 1e-3, 0),
                                                  ("full-lr0.001-s0-k4-n100", 1e-3, 0)])
    assert len(lanes[0]) == 2 and len(lanes[1]) == 1


def test_collect_with_nothing_reusable_keeps_the_earlier_frontier(tmp_path, monkeypatch, capsys):
    earlier = json.dumps({"budget": {}, "points": [_point("lora", 3e-4, 0, 0.0, -0.4)], "dominance": []})
    (tmp_path / "frontier.json").write_text(earlier)  # recorded before points kept their configuration
    _frontier(tmp_path, monkeypatch, "lora", "3e-4", "0", "--collect", fresh=False)
    assert (tmp_path / "frontier.json").read_text() == earlier
    assert "no point to tabulate" in capsys.readouterr().out
