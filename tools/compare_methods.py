#!/usr/bin/env python
"""Run every adaptation method on the embedded default with one token budget and seed, and
write docs/results/compare.md and compare.json: general Δloss (forgetting), domain Δloss (gain),
trainable fraction and wall time per method. About 35-45 minutes on 2 CPU cores.

    python tools/compare_methods.py [--steps 100] [--lr 3e-4] [--seed 0] [--methods adept,full,...]
                                    [--set probe_blocks=32 --set layers=7,14,21,29 ...]
"""
import argparse
import json
from pathlib import Path
from typing import Dict

from adept_ext.train import METHODS, RunConfig, config_from, run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other run option (adept-ext run's names with underscores), for every method")
    parser.add_argument("--out", default="runs/compare", help="run directories (one per method)")
    parser.add_argument("--results", default="docs/results/compare", help="path prefix of the .md and .json results")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: tabulate the finished runs found in --out")
    args = parser.parse_args()
    args.extra = dict(item.split("=", 1) for item in args.set)
    suffix = "".join(f"-{key}{value}" for key, value in args.extra.items())
    rows = []
    for method in args.methods.split(","):
        out = Path(f"{args.out}/{method}-lr{args.lr}-s{args.seed}-k{args.k}-n{args.steps}{suffix}")
        if args.collect and not (out / "report.json").exists():
            continue
        rows.append(run_one(method, args.steps, args.lr, args.seed, args.k, args.extra, out, collect=args.collect))
        print(json.dumps(rows[-1]))
        write_results(args, rows)
    print(f"wrote {Path(args.results).with_suffix('.md')} and {Path(args.results).with_suffix('.json')}")


def run_one(method: str, steps: int, lr: float, seed: int, k: int, extra: Dict[str, str], out: Path,
            collect: bool = False) -> Dict:
    """One `adept-ext run` of `method` into `out` (or its finished report.json when `collect`),
    as a result row: general Δloss (forgetting), domain Δloss (gain), trainable fraction, layers."""
    if collect:
        report = json.loads((out / "report.json").read_text())
    else:
        options = dict(method=method, steps=steps, lr=lr, seed=seed, k=k, warmup_steps=max(1, steps // 10),
                       eval_every=0, save_every=0, out=str(out), overwrite=True)
        defaults = RunConfig()
        options.update({key: type(getattr(defaults, key))(value) for key, value in extra.items()})
        report = run(config_from(options), progress=False)
    return {"method": method, "general_delta": report["forgetting_general_delta"],
            "domain_delta": -report["gain_domain_delta"], "trainable_fraction": report["trainable_fraction"],
            "wall_seconds": report["wall_seconds"], "layers": report["layers"],
            "base": report["base"], "final": report["final"],
            "mean_lr_multiplier": report.get("unit_rates", {}).get("mean_multiplier")}


def write_results(args, rows):
    budget = {"steps": args.steps, "batch": "4 x 128 tokens", "tokens": args.steps * 4 * 128, "lr": args.lr,
              "seed": args.seed, "k": args.k, **args.extra, "model": "smollm2-135m", "general": "bbc-news",
              "domain": "python-docs"}
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"budget": budget, "methods": rows}, indent=2))
    lines = ["# Method comparison on the embedded default", "",
             f"SmolLM2-135M, general = BBC News (held out), domain = Python docs (held out); {args.steps} steps of "
             f"4 x 128 tokens ({budget['tokens']} tokens), AdamW lr {args.lr} (warmup + cosine), seed {args.seed}, "
             f"k = {args.k}"
             + "".join(f", {key} = {value}" for key, value in args.extra.items()) + ".",
             "Forgetting = general held-out Δloss (lower is better); gain = domain held-out Δloss (more negative is "
             "better).", "",
             "| method | general Δloss (forgetting) | domain Δloss (gain) | trainable | wall s | layers |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['general_delta']:+.4f} | {r['domain_delta']:+.4f} | "
              f"{r['trainable_fraction']:.1%} | {r['wall_seconds']} | {r['layers']} |" for r in rows]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
