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
                                      [--set k=2 ...] [--collect]

A variant is a method with some of its options changed (an ablation); it is a row of its own.
Finished runs are reused, so seeds and variants can be added run by run: a run directory in --out
with its report.json, else that row and seed's record in the --results JSON written before at the
same budget (tasks, steps, lr, held-out examples, --set options).
"""
import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Dict, List

from adept_ext.continual import ContinualConfig, config_from, run
from adept_ext.data.tasks import SEQUENCES
from adept_ext.methods import method_names

METRICS = ("AA", "BWT", "FWT", "general_forgetting", "plasticity")


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
    """What makes two runs of a row and seed the same run (the results JSON's budget, less its seeds)."""
    return {"steps_per_task": args.steps, "lr": args.lr, "eval_blocks": args.eval_blocks, **extra}


def task_names(spec: str) -> List[str]:
    """The task names `--tasks spec` learns, in order (a sequence's, or each source's file stem)."""
    return list(SEQUENCES[spec]) if spec in SEQUENCES else [Path(s.strip()).stem for s in spec.split(",") if s.strip()]


def recorded_runs(args, extra) -> Dict:
    """{(label, seed): per-seed record} from the --results JSON when it was written at this budget
    and task sequence, else {}."""
    path = Path(args.results).with_suffix(".json")
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    budget = {k: v for k, v in stored["budget"].items() if k not in ("seeds", "tasks", "batch", "model", "general")}
    if budget != budget_of(args, extra) or stored["budget"]["tasks"] != task_names(args.tasks):
        return {}
    return {(row["label"], record["seed"]): {"trainable_parameters": row["trainable_parameters"],
                                             "tasks": row["tasks"], **record}
            for row in stored["methods"] for record in row["seeds"]}


def seed_record(seed: int, report: Dict) -> Dict:
    """What the tables need of one run's report.json."""
    return {"seed": seed, **{m: report["metrics"][m] for m in ("AA", "BWT", "FWT")},
            "general_forgetting": report["general_forgetting"],
            "plasticity_per_task": (p := plasticity(report["matrix"])), "plasticity": statistics.mean(p),
            "matrix": report["matrix"],
            "subspace_overlap": [t.get("lora_subspace_overlap") for t in report["per_task"]],
            "general_loss": report["general_loss"], "wall_seconds": report["wall_seconds"],
            "trainable_parameters": report["trainable_parameters"], "tasks": report["tasks"]}


def one_run(args, row, seed, extra, recorded: Dict) -> Dict:
    """The per-seed record of `row` on `seed`: from its finished run directory, else from the results
    JSON (`recorded`), else run now (None with --collect)."""
    out = run_dir(args, row, seed, extra)
    if (out / "report.json").exists():
        return seed_record(seed, json.loads((out / "report.json").read_text()))
    if (row["label"], seed) in recorded:
        return recorded[row["label"], seed]
    if args.collect:
        return None
    defaults = ContinualConfig()
    options = dict(method=row["method"], tasks=args.tasks, steps=args.steps, lr=args.lr, seed=seed,
                   eval_blocks=args.eval_blocks, warmup_steps=max(1, args.steps // 10), save_every=0, out=str(out),
                   overwrite=True)
    for key, value in {**extra, **row["options"]}.items():
        kind = type(getattr(defaults, key))
        options[key] = value.lower() in ("1", "true", "yes", "on") if kind is bool else kind(value)
    return seed_record(seed, run(config_from(options), progress=False))


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
    return {"label": row["label"], "method": row["method"], "options": row["options"],
            **{m: mean([s[m] for s in per_seed]) for m in METRICS},
            "spread": {m: spread([s[m] for s in per_seed]) for m in METRICS},
            "plasticity_per_task": plasticity(matrix), "matrix": matrix,
            "subspace_overlap": [mean([s["subspace_overlap"][i] for s in per_seed])
                                 for i in range(len(first["tasks"]))],
            "final_scores": matrix[-1], "final_general_loss": mean([s["general_loss"][-1] for s in per_seed]),
            "trainable_parameters": first["trainable_parameters"],
            "wall_seconds": mean([s["wall_seconds"] for s in per_seed]),
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
    parser.add_argument("--collect", action="store_true", help="run nothing: tabulate the finished runs in --out")
    args = parser.parse_args()
    extra = parse_options(",".join(args.set))
    seeds = [int(s) for s in args.seeds.split(",")]
    recorded = recorded_runs(args, extra)
    results = []
    for row in rows_to_run(args):
        records = [record for seed in seeds if (record := one_run(args, row, seed, extra, recorded)) is not None]
        if not records:
            continue
        results.append(summarize(row, records))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("seeds", "tasks")}))
        write_results(args, extra, seeds, results)
    print(f"wrote {Path(args.results).with_suffix('.md')} and {Path(args.results).with_suffix('.json')}")


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


def write_results(args, extra, seeds, rows):
    from adept_ext.report import plot_matrix

    tasks = rows[0]["tasks"]
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
    lines += [f"| {r['label']} | {', '.join(str(s['seed']) for s in r['seeds'])} | "
              f"{_with_seeds(r, 'AA', lambda v: f'{v:.4f}')} | {_with_seeds(r, 'BWT', _signed)} | "
              f"{_with_seeds(r, 'FWT', _signed)} | {_with_seeds(r, 'plasticity', _signed)} | "
              f"{plasticity_ratio(r, reference)} | {_with_seeds(r, 'general_forgetting', _signed)} | "
              f"{', '.join(f'{n / 1e6:.2f}M' for n in r['trainable_parameters'])} | {r['wall_seconds']:.0f} |"
              for r in rows]
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
    base = [(s["seed"], s["matrix"][0], s["general_loss"][0]) for s in rows[0]["seeds"]]
    lines += [""] + [f"Base model, seed {seed}: " + ", ".join(f"{n} {v:.4f}" for n, v in zip(names, scores))
                     + f", general loss {general:.4f}." for seed, scores, general in base]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
