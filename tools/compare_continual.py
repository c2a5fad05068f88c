#!/usr/bin/env python
"""Run continual-learning methods on one task sequence with one budget over one or more seeds,
and write docs/results/continual-classification.md and .json (--results): per method (and per ablation variant) the
score matrix a[t][i] (also as a heatmap, PNG), AA, BWT, FWT, plasticity, general forgetting,
trainable parameters and wall time, as the mean over the seeds ± half their range, with every
seed's value beside it. Plasticity of task i = a[i][i] − a[0][i] (its score right after it was
learned minus the base model's); the table gives each method's smallest ratio to seq_lora's.

    python tools/compare_continual.py [--tasks classification] [--steps 40] [--lr 1e-3] [--eval-blocks 64]
                                      [--seeds 0,1] [--methods seq_full,seq_lora,...]
                                      [--variant eoupct:eoupct_proxy=embeds,eoupct_virtual=false ...]
                                      [--set k=2 ...] [--benchmarks adept_arc_easy [--limit N]] [--collect]

A variant is a method with some of its options changed (an ablation); it is a row of its own.
`--benchmarks` scores the base and the final model of every run with lm-eval (each run's
`--benchmarks-every` is 0 unless --set says otherwise): a column per benchmark metric, its final value
and its change from the base model.

Finished runs are reused, so seeds and variants can be added run by run, and the tables keep the rows
of the --results JSON that this call does not name. A run is reused when its resolved configuration
(`training.result_options`: every option that changes what it computes, defaults included, the
method's own options alone; an option added after the run, at its default: `as_recorded_today`)
and its task list equal this call's: a run directory in --out with its report.json, else a record
in the --results JSON. A record run without --benchmarks (or with other
benchmark options) is reused when no benchmark is asked for, and run again when one is.
"""
import argparse
import functools
import json
import re
import statistics
from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional

from adept_ext.continual import ContinualConfig, config_from, run
from adept_ext.data.tasks import SEQUENCES
from adept_ext.errors import RunError
from adept_ext.methods import method_names
from adept_ext.training import BenchmarkOptions, as_recorded_today, result_options, typed_options

METRICS = ("AA", "BWT", "FWT", "general_forgetting", "plasticity")
BENCHMARK_OPTIONS = {f.name for f in fields(BenchmarkOptions)} | {"benchmarks_every"}


def plasticity(matrix: List[List[float]]) -> List[float]:
    """a[i][i] − a[0][i] per task i (row i of the matrix: after task i; row 0: the base model)."""
    return [matrix[i + 1][i] - matrix[0][i] for i in range(len(matrix[0]))]


def parse_options(text: str) -> Dict[str, str]:
    """"a=1,b=x" -> {"a": "1", "b": "x"}."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def rows_to_run(args) -> List[Dict]:
    """[{"label", "method", "options"}] for every plain method and every --variant."""
    rows = [{"label": m, "method": m, "options": {}} for m in args.methods.split(",") if m]
    for variant in args.variant:
        method, _, options = variant.partition(":")
        options = parse_options(options)
        label = f"{method} [{', '.join(f'{k}={v}' for k, v in options.items())}]" if options else method
        rows.append({"label": label, "method": method, "options": options})
    return rows


def run_dir(args, row, seed, extra) -> Path:
    options = {**extra, **row["options"]}
    suffix = "".join(f"-{key}{value}" for key, value in options.items())
    return Path(f"{args.out}/{row['method']}-lr{args.lr}-s{seed}-n{args.steps}-e{args.eval_blocks}{suffix}")


def budget_of(args, extra) -> Dict:
    """What the table's header states of every row (the results JSON's budget, less its seeds)."""
    return {"steps_per_task": args.steps, "lr": args.lr, "eval_blocks": args.eval_blocks, **extra}


def task_names(spec: str) -> List[str]:
    """The task names `--tasks spec` learns, in order (a sequence's, or each source's file stem)."""
    return list(SEQUENCES[spec]) if spec in SEQUENCES else [Path(s.strip()).stem for s in spec.split(",") if s.strip()]


def run_options(args, row, seed, extra) -> Dict:
    """The options of `adept-ext continual` for `row` on `seed` (`config_from`'s input)."""
    options = dict(method=row["method"], tasks=args.tasks, steps=args.steps, lr=args.lr, seed=seed,
                   eval_blocks=args.eval_blocks, warmup_steps=max(1, args.steps // 10), save_every=0,
                   out=str(run_dir(args, row, seed, extra)), overwrite=True)
    if args.benchmarks:
        options.update(benchmarks=args.benchmarks, limit=args.limit, benchmarks_every=0)
    return {**options, **typed_options(ContinualConfig(), {**extra, **row["options"]})}


@functools.lru_cache(maxsize=None)
def default_options(method: str) -> Dict:
    """`result_options` of `adept-ext continual --method METHOD` with every other option at its default."""
    return result_options(config_from({"method": method}))


def reusable(record: Dict, wanted: Dict, tasks: List[str]) -> bool:
    """Whether a run's per-seed record answers for the run of resolved options `wanted` on `tasks`:
    the same options as they read today (`as_recorded_today`; the benchmark options too where a
    benchmark is asked for) and task list."""
    config = record.get("config")
    if config is None or [t["name"] for t in record["tasks"]] != tasks:
        return False
    try:
        config = as_recorded_today(config, default_options(config["method"]))
    except RunError:  # a method no longer offered
        return False
    keys = [k for k in wanted if k not in BENCHMARK_OPTIONS or wanted["benchmarks"]]
    return all(k in config and config[k] == wanted[k] for k in keys)


def recorded_runs(args) -> List[Dict]:
    """Every per-seed record of the --results JSON (with its row's trainable parameters and tasks)."""
    path = Path(args.results).with_suffix(".json")
    if not path.exists():
        return []
    return [{"trainable_parameters": row["trainable_parameters"], "tasks": row["tasks"], **record}
            for row in json.loads(path.read_text())["methods"] for record in row["seeds"]]


def seed_record(seed: int, report: Dict, config: Dict) -> Dict:
    """What the tables need of one run's report.json (`config`: its resolved options)."""
    return {"seed": seed, "config": config, **{m: report["metrics"][m] for m in ("AA", "BWT", "FWT")},
            "general_forgetting": report["general_forgetting"],
            "plasticity_per_task": (p := plasticity(report["matrix"])), "plasticity": statistics.mean(p),
            "matrix": report["matrix"],
            "subspace_overlap": [t.get("lora_subspace_overlap") for t in report["per_task"]],
            "general_loss": report["general_loss"], "wall_seconds": report["wall_seconds"],
            "benchmarks": {f"{task} {metric}": entry for task, metrics in report.get("benchmark_difference", {}).items()
                           for metric, entry in metrics.items()},
            "trainable_parameters": report["trainable_parameters"], "tasks": report["tasks"]}


def one_run(args, row, seed, extra, recorded: List[Dict]) -> Dict:
    """The per-seed record of `row` on `seed`: from its finished run directory, else from the results
    JSON (`recorded`), when reusable there; else run now (None with --collect)."""
    options = run_options(args, row, seed, extra)
    cfg = config_from(options)
    wanted, tasks = result_options(cfg), task_names(args.tasks)
    report_path = Path(options["out"]) / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        record = seed_record(seed, report, {k: report["config"][k] for k in wanted if k in report["config"]})
        if reusable(record, wanted, tasks):
            return record
    found = next((r for r in recorded if reusable(r, wanted, tasks)), None)
    if found is not None or args.collect:
        return found
    return seed_record(seed, run(cfg, progress=False), wanted)


def paired_count(entries) -> Optional[List[int]]:
    """[seeds whose change the paired test calls real at 5 %, seeds with a paired test]; None without one."""
    tested = [e for e in entries if e]
    return [sum(bool(e["significant"]) for e in tested), len(tested)] if tested else None


def summarize(row, per_seed: List[Dict]) -> Dict:
    """Mean over the seeds of every metric, with each seed's record."""
    first = per_seed[0]

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    def spread(values):
        values = [v for v in values if v is not None]
        return (max(values) - min(values)) / 2 if len(values) > 1 else None

    matrix = [[mean([s["matrix"][t][i] for s in per_seed]) for i in range(len(first["tasks"]))]
              for t in range(len(first["matrix"]))]
    scored = [s.get("benchmarks", {}) for s in per_seed]
    benchmarks = {key: {"final": mean([b[key]["final"] for b in scored]),
                        "delta": mean([b[key]["delta"] for b in scored]),
                        "delta_spread": spread([b[key]["delta"] for b in scored]),
                        "stderr": mean([b[key]["stderr"] for b in scored]),
                        "paired_real": paired_count([b[key].get("paired") for b in scored])}
                  for key in scored[0] if all(key in b for b in scored)}
    return {"label": row["label"], "method": row["method"], "options": row["options"],
            **{m: mean([s[m] for s in per_seed]) for m in METRICS},
            "spread": {m: spread([s[m] for s in per_seed]) for m in METRICS},
            "plasticity_per_task": plasticity(matrix), "matrix": matrix,
            "subspace_overlap": [mean([s["subspace_overlap"][i] for s in per_seed])
                                 for i in range(len(first["tasks"]))],
            "final_scores": matrix[-1], "final_general_loss": mean([s["general_loss"][-1] for s in per_seed]),
            "trainable_parameters": first["trainable_parameters"],
            "wall_seconds": mean([s["wall_seconds"] for s in per_seed]), "benchmarks": benchmarks,
            "seeds": [{k: v for k, v in s.items() if k not in ("trainable_parameters", "tasks")} for s in per_seed],
            "tasks": first["tasks"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="classification")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per task")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out examples (blocks) per task")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; the tables give the mean")
    parser.add_argument("--methods", default=",".join(method_names(sequence=True)))
    parser.add_argument("--variant", action="append", default=[], metavar="METHOD:OPTION=VALUE[,OPTION=VALUE]",
                        help="a method with changed options, as a row of its own (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other option of adept-ext continual (names with underscores), for every method")
    parser.add_argument("--out", default="runs/continual-compare", help="run directories (one per method and seed)")
    parser.add_argument("--results", default="docs/results/continual-classification",
                        help="path prefix of the .md and .json results")
    parser.add_argument("--benchmarks", default="",
                        help="lm-eval tasks scored on the base and the final model of every run (adept-ext's names)")
    parser.add_argument("--limit", type=int, default=-1, help="at most N items per benchmark (lm-eval's --limit)")
    parser.add_argument("--collect", action="store_true", help="run nothing: tabulate the finished runs in --out")
    args = parser.parse_args()
    extra = parse_options(",".join(args.set))
    seeds = [int(s) for s in args.seeds.split(",")]
    recorded = recorded_runs(args)
    results = earlier_rows(args, extra)
    for row in results.values():
        row["stale"] = not current(args, extra, row)
    for row in rows_to_run(args):
        records = [record for seed in seeds if (record := one_run(args, row, seed, extra, recorded)) is not None]
        if not records:
            continue
        results[row["label"]] = summarize(row, records)
        print(json.dumps({k: v for k, v in results[row["label"]].items() if k not in ("seeds", "tasks")}))
        write_results(args, extra, list(results.values()))
    print(f"wrote {Path(args.results).with_suffix('.md')} and {Path(args.results).with_suffix('.json')}")


def current(args, extra, row: Dict) -> bool:
    """Whether every seed of a results row was run under the options this call would run it with
    (benchmarks aside): False for a row recorded before runs kept their configuration, or under a
    default that changed since. Such a row stays in the tables, marked †."""
    plain = argparse.Namespace(**{**vars(args), "benchmarks": ""})
    spec = {"label": row["label"], "method": row["method"], "options": row["options"]}
    return all(reusable({**s, "tasks": row["tasks"]},
                        result_options(config_from(run_options(plain, spec, s["seed"], extra))), task_names(args.tasks))
               for s in row["seeds"])


def earlier_rows(args, extra) -> Dict[str, Dict]:
    """{label: row} of the --results JSON when its header's budget and tasks are this call's, else {}:
    the rows this call does not name stay in the tables."""
    path = Path(args.results).with_suffix(".json")
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    budget = {k: v for k, v in stored["budget"].items() if k not in ("seeds", "tasks", "batch", "model", "general")}
    if budget != budget_of(args, extra) or stored["budget"]["tasks"] != task_names(args.tasks):
        return {}
    return {row["label"]: row for row in stored["methods"]}


def _signed(value) -> str:
    return "n/a" if value is None else f"{value:+.4f}"


def _with_seeds(row, metric, fmt) -> str:
    """The mean, ± half the seeds' range and each seed's value in brackets when there is more than one."""
    text = fmt(row[metric])
    if len(row["seeds"]) > 1:
        text += f" ± {abs(row['spread'][metric]):.3f} (" + " / ".join(fmt(s[metric]) for s in row["seeds"]) + ")"
    return text


def plasticity_ratio(row, reference) -> str:
    """The smallest per-task ratio of `row`'s plasticity to the reference's (seq_lora's)."""
    if reference is None:
        return "n/a"
    ratios = [p / q for p, q in zip(row["plasticity_per_task"], reference["plasticity_per_task"]) if q > 0]
    return f"{min(ratios):.2f}" if ratios else "n/a"


def benchmark_table(rows) -> List[str]:
    """Markdown lines: per row, each benchmark metric's final value and its change from the base model
    (mean over the seeds, ± half their range, and the mean of lm-eval's combined stderr of the change);
    – where the row's runs were not scored on it. Nothing when no row was."""
    keys = list(dict.fromkeys(k for r in rows for k in r.get("benchmarks", {})))
    if not keys:
        return []
    lines = ["", "Benchmarks (lm-eval, base and final model of every run): the final value, and in brackets its "
             "change from the base model ± half the seeds' range, then the stderr of that change (lm-eval's, "
             "the two scores taken as independent) and in how many seeds the paired test on the same items "
             "(McNemar's exact test) calls the change real at 5 %:", "",
             "| method | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for key in keys:
            b = r.get("benchmarks", {}).get(key)
            spread = "" if b is None or b["delta_spread"] is None else f" ± {b['delta_spread']:.3f}"
            stderr = "" if b is None or b["stderr"] is None else f", se {b['stderr']:.3f}"
            real = "" if b is None or not b.get("paired_real") else \
                f"; paired: real in {b['paired_real'][0]}/{b['paired_real'][1]}"
            cells.append("–" if b is None else f"{b['final']:.4f} ({b['delta']:+.4f}{spread}{stderr}{real})")
        lines.append(f"| {r['label']} | {', '.join(str(s['seed']) for s in r['seeds'])} | " + " | ".join(cells) + " |")
    return lines


def write_results(args, extra, rows):
    from adept_ext.report import plot_matrix

    tasks = rows[0]["tasks"]
    seeds = sorted({s["seed"] for r in rows for s in r["seeds"]})
    budget = {"tasks": [t["name"] for t in tasks], "steps_per_task": args.steps, "lr": args.lr, "seeds": seeds,
              "eval_blocks": args.eval_blocks, "batch": "4 x 128 tokens", **extra, "model": "smollm2-135m",
              "general": "bbc-news (held out)"}
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"budget": budget, "methods": rows}, indent=2))
    names = [f"{t['name']} ({t['metric']})" for t in tasks]
    heatmaps = Path(f"{path}-heatmaps")
    heatmaps.mkdir(exist_ok=True)
    for r in rows:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", r["label"]).strip("_")
        plot_matrix(r["matrix"], ["base"] + [f"after {t['name']}" for t in tasks], [t["name"] for t in tasks],
                    heatmaps / f"{name}.png", f"{r['label']} (mean over seeds)")
    reference = next((r for r in rows if r["label"] == "seq_lora"), None)
    seed_text = (f"seed {seeds[0]}" if len(seeds) == 1 else
                 f"mean over seeds {', '.join(map(str, seeds))} ± half their range (each seed's value in brackets)")
    lines = ["# Continual-learning comparison", "",
             f"SmolLM2-135M learns {' → '.join(budget['tasks'])} in order; {args.steps} AdamW steps of 4 x 128 tokens "
             f"per task, lr {args.lr} (warmup + cosine per task), {args.eval_blocks} held-out examples per task, "
             f"{seed_text}" + "".join(f", {key} = {value}" for key, value in extra.items()) + ".",
             "Scores: accuracy for instruction tasks, −loss for text tasks (higher is better). AA = mean final score; "
             "BWT = mean change of a task's score from just after it was learned to the end (negative = forgetting); "
             "FWT = mean score of a task before it was learned minus the base model's; plasticity = mean over the "
             "tasks of the score right after learning a task minus the base model's (the next column: its smallest "
             "per-task ratio to seq_lora's); general forgetting = general held-out loss at the end minus the base "
             "model's (lower is better). Rows with options in brackets are variants of the method. "
             f"Heatmaps of the mean score matrices: `{heatmaps.name}/`.", "",
             "| method | seeds | AA | BWT | FWT | plasticity | min ratio to seq_lora | general forgetting "
             "| trainable per task | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['label']}{' †' if r.get('stale') else ''} | {', '.join(str(s['seed']) for s in r['seeds'])} | "
              f"{_with_seeds(r, 'AA', lambda v: f'{v:.4f}')} | {_with_seeds(r, 'BWT', _signed)} | "
              f"{_with_seeds(r, 'FWT', _signed)} | {_with_seeds(r, 'plasticity', _signed)} | "
              f"{plasticity_ratio(r, reference)} | {_with_seeds(r, 'general_forgetting', _signed)} | "
              f"{', '.join(f'{n / 1e6:.2f}M' for n in r['trainable_parameters'])} | {r['wall_seconds']:.0f} |"
              for r in rows]
    if any(r.get("stale") for r in rows):
        lines += ["", "† Run before runs kept their configuration, or under a default that changed since: kept as "
                  "recorded, not rerun (`tools/compare_continual.py` reruns it when the row is named)."]
    lines += ["", "Final scores per task (row T of the matrix, mean over the seeds) and general loss:", "",
              "| method | " + " | ".join(names) + " | general loss |", "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {r['label']} | " + " | ".join(f"{s:.4f}" for s in r["final_scores"])
              + f" | {r['final_general_loss']:.4f} |" for r in rows]
    lines += ["", "Plasticity per task (mean over the seeds):", "",
              "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {r['label']} | " + " | ".join(f"{v:+.4f}" for v in r["plasticity_per_task"]) + " |" for r in rows]
    overlaps = [r for r in rows if any(v is not None for v in r["subspace_overlap"])]
    if overlaps:
        lines += ["", "`lora_subspace_overlap` at the end of each task: ‖A_{<t} A_tᵀ‖_F of the task's A's with "
                  "the earlier tasks' (stacked), mean over the adapted projections and the seeds:", "",
                  "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {r['label']} | " + " | ".join("–" if v is None else f"{v:.4f}" for v in r["subspace_overlap"])
                  + " |" for r in overlaps]
    lines += benchmark_table(rows)
    base = [(s["seed"], s["matrix"][0], s["general_loss"][0]) for s in rows[0]["seeds"]]
    lines += [""] + [f"Base model, seed {seed}: " + ", ".join(f"{n} {v:.4f}" for n, v in zip(names, scores))
                     + f", general loss {general:.4f}." for seed, scores, general in base]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
