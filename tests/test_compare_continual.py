"""tools/compare_continual.py's bookkeeping (no training): a recorded run is reused only under the
same resolved configuration (`training.result_options`), benchmark columns, rows kept from the
results written before."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from adept_ext.continual import config_from
from adept_ext.training import result_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compare_continual as cc  # noqa: E402

TASKS = list(cc.SEQUENCES["classification"])


def _args(tmp_path, **changes):
    values = dict(tasks="classification", steps=40, lr=1e-3, eval_blocks=64, out=str(tmp_path / "runs"),
                  results=str(tmp_path / "results"), benchmarks="", limit=-1, collect=True)
    return SimpleNamespace(**{**values, **changes})


def _record(config, seed=0, benchmarks=None, tasks=TASKS):
    """A per-seed record as seed_record writes it (the fields the tables read)."""
    n = len(tasks)
    matrix = [[0.0] * n] + [[0.5 + 0.1 * i] * n for i in range(n)]
    report = {"metrics": {"AA": 0.6, "BWT": -0.1, "FWT": 0.0}, "general_forgetting": 0.2, "matrix": matrix,
              "per_task": [{}] * n, "general_loss": [3.0, 3.2], "wall_seconds": 10.0,
              "benchmark_difference": benchmarks or {}, "trainable_parameters": [100] * n,
              "tasks": [{"name": t, "metric": "accuracy"} for t in tasks]}
    return cc.seed_record(seed, report, config)


def _wanted(tmp_path, method="seq_lora", seed=0, **args_changes):
    args = _args(tmp_path, **args_changes)
    row = {"label": method, "method": method, "options": {}}
    return result_options(config_from(cc.run_options(args, row, seed, {})))


def test_result_options_hold_what_changes_a_result(tmp_path):
    options = _wanted(tmp_path)
    assert options["method"] == "seq_lora" and options["lora_rank"] == 8 and options["steps"] == 40
    assert "o_lora_lambda" not in options and "deal_rank" not in options  # other methods' options
    assert not {"out", "save_every", "report_to", "overwrite", "dataloader_num_workers"} & set(options)
    assert _wanted(tmp_path, "o_lora")["o_lora_penalty"] == "fro2"


def test_a_run_is_reused_only_under_its_resolved_configuration(tmp_path):
    wanted = _wanted(tmp_path)
    assert cc.reusable(_record(wanted), wanted, TASKS)
    assert not cc.reusable(_record({**wanted, "lora_rank": 16}), wanted, TASKS)  # a changed method default
    assert not cc.reusable(_record({**wanted, "max_length": 256}), wanted, TASKS)  # a changed runner default
    assert not cc.reusable(_record(_wanted(tmp_path, seed=1)), wanted, TASKS)
    assert not cc.reusable(_record(wanted, tasks=TASKS[::-1]), wanted, TASKS)
    missing = {k: v for k, v in wanted.items() if k != "truncation_mode"}  # recorded before the option existed:
    assert cc.reusable(_record(missing), wanted, TASKS)  # its default, the behaviour before it, is what ran
    keep_start = _wanted(tmp_path, seed=0)
    keep_start["truncation_mode"] = "keep_start"
    assert not cc.reusable(_record(missing), keep_start, TASKS)
    assert cc.reusable(_record({**wanted, "option_since_removed": 1}), wanted, TASKS)
    legacy = _record(wanted)
    del legacy["config"]
    assert not cc.reusable(legacy, wanted, TASKS)
    # under another label (a variant row whose options are the defaults) the same run is the same run
    args = _args(tmp_path)
    variant = {"label": "seq_lora [lora_rank=8]", "method": "seq_lora", "options": {"lora_rank": "8"}}
    assert result_options(config_from(cc.run_options(args, variant, 0, {}))) == wanted


def test_benchmark_options_count_only_when_a_benchmark_is_asked_for(tmp_path):
    plain = _wanted(tmp_path)
    scored = _wanted(tmp_path, benchmarks="adept_arc_easy", limit=50)
    assert scored["benchmarks"] == "adept_arc_easy" and scored["benchmarks_every"] == 0
    assert cc.reusable(_record(scored), plain, TASKS)  # a scored run answers for an unscored one
    assert not cc.reusable(_record(plain), scored, TASKS)  # not the other way round
    assert not cc.reusable(_record({**scored, "limit": 100}), scored, TASKS)
    assert cc.reusable(_record(scored), scored, TASKS)


def test_one_run_takes_a_matching_record_and_skips_a_stale_one(tmp_path):
    args = _args(tmp_path)
    row = {"label": "seq_lora", "method": "seq_lora", "options": {}}
    wanted = _wanted(tmp_path)
    stale, fresh = _record({**wanted, "lora_rank": 4}), _record(wanted)
    fresh["AA"] = 0.9
    assert cc.one_run(args, row, 0, {}, [stale]) is None  # --collect: nothing reusable, nothing run
    assert cc.one_run(args, row, 0, {}, [stale, fresh])["AA"] == 0.9


def test_benchmark_columns_and_rows_kept_from_earlier_results(tmp_path):
    args = _args(tmp_path)
    arc = {"adept_arc_easy": {"acc": {"base": 0.40, "final": 0.38, "delta": -0.02, "stderr": 0.03,
                                      "beyond_2se": False, "paired": {"significant": True}}}}
    wanted = _wanted(tmp_path)
    seq_lora = cc.summarize({"label": "seq_lora", "method": "seq_lora", "options": {}},
                            [_record(wanted, 0, arc), _record({**wanted, "seed": 1}, 1, {
                                "adept_arc_easy": {"acc": {**arc["adept_arc_easy"]["acc"], "final": 0.36,
                                                           "delta": -0.04, "paired": {"significant": False}}}})])
    o_lora = cc.summarize({"label": "o_lora", "method": "o_lora", "options": {}},
                          [_record(_wanted(tmp_path, "o_lora"))])
    assert seq_lora["benchmarks"]["adept_arc_easy acc"]["delta"] == -0.03
    assert seq_lora["benchmarks"]["adept_arc_easy acc"]["delta_spread"] == 0.01
    cc.write_results(args, {}, [seq_lora, o_lora])
    table = Path(args.results).with_suffix(".md").read_text()
    assert "| seq_lora | 0, 1 | 0.3700 (-0.0300 ± 0.010, se 0.030; paired: real in 1/2) |" in table
    assert "| o_lora | 0 | – |" in table
    kept = cc.earlier_rows(args, {})
    assert list(kept) == ["seq_lora", "o_lora"] and kept["seq_lora"]["seeds"][1]["seed"] == 1
    assert json.loads(Path(args.results).with_suffix(".json").read_text())["budget"]["seeds"] == [0, 1]
    assert cc.current(args, {}, kept["seq_lora"]) and cc.current(args, {}, kept["o_lora"])
    legacy = {**kept["o_lora"], "seeds": [{k: v for k, v in kept["o_lora"]["seeds"][0].items() if k != "config"}]}
    assert not cc.current(args, {}, legacy)  # recorded before runs kept their configuration
    cc.write_results(args, {}, [seq_lora, {**legacy, "stale": True}])
    table = Path(args.results).with_suffix(".md").read_text()
    assert "| o_lora † | 0 |" in table and "| seq_lora | 0, 1 |" in table and "† Run before runs kept" in table
    assert cc.earlier_rows(_args(tmp_path, steps=20), {}) == {}  # another budget: a table of its own
    assert cc.earlier_rows(_args(tmp_path, tasks="builtin"), {}) == {}
