#!/usr/bin/env python
"""Run every continual-learning method on one task sequence with one budget and seed, and write
docs/results/continual.md and continual.json: per method the score matrix a[t][i], AA, BWT, FWT,
general forgetting, trainable parameters and wall time.

    python tools/compare_continual.py [--tasks builtin] [--steps 40] [--lr 3e-4] [--seed 0]
                                      [--methods seq_full,seq_lora,...] [--set k=2 ...] [--collect]
"""
import argparse
import json
from pathlib import Path

from adept_ext.continual import ContinualConfig, config_from, run
from adept_ext.methods import method_names


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ContinualConfig()
    parser.add_argument("--tasks", default=defaults.tasks)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per task")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(method_names(sequence=True)))
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other option of adept-ext continual (names with underscores), for every method")
    parser.add_argument("--out", default="runs/continual-compare", help="run directories (one per method)")
    parser.add_argument("--results", default="docs/results/continual", help="path prefix of the .md and .json results")
    parser.add_argument("--collect", action="store_true", help="run nothing: tabulate the finished runs in --out")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.set)
    suffix = "".join(f"-{key}{value}" for key, value in extra.items())
    rows = []
    for method in args.methods.split(","):
        out = Path(f"{args.out}/{method}-lr{args.lr}-s{args.seed}-n{args.steps}{suffix}")
        if args.collect:
            if not (out / "report.json").exists():
                continue
            report = json.loads((out / "report.json").read_text())
        else:
            options = dict(method=method, tasks=args.tasks, steps=args.steps, lr=args.lr, seed=args.seed,
                           warmup_steps=max(1, args.steps // 10), save_every=0, out=str(out), overwrite=True)
            options.update({key: type(getattr(defaults, key))(value) for key, value in extra.items()})
            report = run(config_from(options), progress=False)
        rows.append({"method": method, **report["metrics"], "general_forgetting": report["general_forgetting"],
                     "matrix": report["matrix"], "general_loss": report["general_loss"],
                     "trainable_parameters": report["trainable_parameters"], "wall_seconds": report["wall_seconds"],
                     "tasks": report["tasks"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("matrix", "tasks")}))
        write_results(args, extra, rows)
    print(f"wrote {Path(args.results).with_suffix('.md')} and {Path(args.results).with_suffix('.json')}")


def _signed(value) -> str:
    return "n/a" if value is None else f"{value:+.4f}"


def write_results(args, extra, rows):
    tasks = rows[0]["tasks"]
    budget = {"tasks": [t["name"] for t in tasks], "steps_per_task": args.steps, "lr": args.lr, "seed": args.seed,
              "batch": "4 x 128 tokens", **extra, "model": "smollm2-135m", "general": "bbc-news (held out)"}
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"budget": budget, "methods": rows}, indent=2))
    names = [f"{t['name']} ({t['metric']})" for t in tasks]
    lines = ["# Continual-learning comparison", "",
             f"SmolLM2-135M learns {' → '.join(budget['tasks'])} in order; {args.steps} AdamW steps of 4 x 128 tokens "
             f"per task, lr {args.lr} (warmup + cosine per task), seed {args.seed}"
             + "".join(f", {key} = {value}" for key, value in extra.items()) + ".",
             "Scores: accuracy for instruction tasks, −loss for text tasks (higher is better). AA = mean final score; "
             "BWT = mean change of a task's score from just after it was learned to the end (negative = forgetting); "
             "FWT = mean score of a task before it was learned minus the base model's; general forgetting = general "
             "held-out loss at the end minus the base model's (lower is better).", "",
             "| method | AA | BWT | FWT | general forgetting | trainable per task | wall s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['AA']:.4f} | {_signed(r['BWT'])} | {_signed(r['FWT'])} | "
              f"{r['general_forgetting']:+.4f} | {', '.join(f'{n / 1e6:.2f}M' for n in r['trainable_parameters'])} | "
              f"{r['wall_seconds']} |" for r in rows]
    lines += ["", "Final scores per task (row T of the matrix) and general loss:", "",
              "| method | " + " | ".join(names) + " | general loss |", "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {r['method']} | " + " | ".join(f"{s:.4f}" for s in r["matrix"][-1]) + f" | {r['general_loss'][-1]:.4f} |"
              for r in rows]
    lines += ["", "Base model: " + ", ".join(f"{n} {s:.4f}" for n, s in zip(names, rows[0]["matrix"][0]))
              + f", general loss {rows[0]['general_loss'][0]:.4f}."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
