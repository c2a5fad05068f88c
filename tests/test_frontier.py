"""tools/frontier.py's bookkeeping (no training): which earlier results it may reuse, the
dominance verdicts it reports, and the files it writes."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import frontier  # noqa: E402


def _comparison(path, lr, seed, rows, **extra):
    budget = {"steps": 100, "batch": "4 x 128 tokens", "tokens": 51200, "lr": lr, "seed": seed, "k": 4,
              **extra, "model": "smollm2-135m", "general": "bbc-news", "domain": "python-docs"}
    path.write_text(json.dumps({"budget": budget, "methods": rows}))
    return str(path)


def test_reuses_only_runs_with_identical_settings(tmp_path):
    row = {"method": "lora", "general_delta": -0.01, "domain_delta": -0.4, "layers": []}
    paths = [_comparison(tmp_path / "a.json", 3e-4, 0, [row]),  # before probe_blocks was recorded: 8
             _comparison(tmp_path / "b.json", 1e-3, 1, [row], probe_blocks="32"),  # another probe size
             _comparison(tmp_path / "c.json", 1e-3, 0, [row], layers="7,14")]  # a different run
    found = frontier.reusable(paths, steps=100, k=4, extra={"probe_blocks": "8"})
    assert list(found) == [("lora", 3e-4, 0)] and found[("lora", 3e-4, 0)]["source"] == paths[0]
    assert frontier.reusable(paths, steps=50, k=4, extra={"probe_blocks": "8"}) == {}
    assert frontier.reusable(paths, steps=100, k=4, extra={"probe_blocks": "4"}) == {}


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


def test_earlier_frontier_points_are_reused_only_under_the_same_budget(tmp_path):
    args = SimpleNamespace(results=str(tmp_path / "frontier"), steps=100, k=4)
    variants = [frontier.parse_method("adept:placement=spread")]
    points = [_point("adept spread", 3e-4, 0, -0.01, -0.39)]
    frontier.write_results(args, {"probe_blocks": "8"}, [3e-4], [0], variants, points)
    path = tmp_path / "frontier.json"
    grown = frontier.frontier_budget(args, {"probe_blocks": "8"}, [3e-4, 1e-3], [0, 1])  # more lrs and seeds: same runs
    assert frontier.earlier_frontier(path, grown)[("adept spread", 3e-4, 0)]["domain_delta"] == -0.39
    other = frontier.frontier_budget(SimpleNamespace(steps=50, k=4), {"probe_blocks": "8"}, [3e-4], [0])
    assert frontier.earlier_frontier(path, other) == {}
    assert frontier.earlier_frontier(tmp_path / "missing.json", grown) == {}
