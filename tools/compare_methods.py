#!/usr/bin/env python
"""Run every adaptation method on the embedded default with one token budget and seed, and
write docs/results/compare.md and compare.json: general Δloss (forgetting), domain Δloss (gain),
trainable fraction and wall time per method, and with `--benchmarks` each lm-eval metric's final
value and its change from the base model. About 35-45 minutes on 2 CPU cores.

    python tools/compare_methods.py [--steps 100] [--lr 3e-4] [--seed 0] [--methods adept,full,...]
                                    [--set probe_blocks=32 --set layers=7,14,21,29 ...]
                                    [--benchmarks adept_arc_easy [--limit N]] [--collect]

Every row records its run's resolved configuration ("config": `training.result_options`, every
option that changes what the run computes, defaults included, the method's own options alone);
tools/frontier.py reuses a row only where it equals the configuration it would run. `--collect`
tabulates a finished run in --out only where its report.json's configuration is the one this call
would run (a run made before a default changed is left out, and named).
"""
import argparse
import functools
import json
from pathlib import Path
from typing import Dict, List, Optional

from adept_ext.train import METHODS, RunConfig, config_from, run
from adept_ext.training import as_recorded_today, result_options, typed_options


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other run option (adept-ext run's names with underscores), for every method")
    parser.add_argument("--benchmarks", default="",
                        help="lm-eval tasks scored on the base and the final model of every run, comma-separated "
                             "(adept-ext run's --benchmarks, e.g. adept_arc_easy)")
    parser.add_argument("--limit", type=int, default=-1,
                        help="with --benchmarks: at most N items per benchmark (lm-eval's --limit)")
    parser.add_argument("--out", default="runs/compare", help="run directories (one per method)")
    parser.add_argument("--results", default="docs/results/compare", help="path prefix of the .md and .json results")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: tabulate the finished runs found in --out")
    args = parser.parse_args(argv)
    args.extra = dict(item.split("=", 1) for item in args.set)
    if args.benchmarks:  # run options like any other: in the run directory's name and the budget
        args.extra.update(benchmarks=args.benchmarks, **({"limit": str(args.limit)} if args.limit != -1 else {}))
    suffix = "".join(f"-{key}{value}" for key, value in args.extra.items())
    rows = []
    for method in args.methods.split(","):
        out = Path(f"{args.out}/{method}-lr{args.lr}-s{args.seed}-k{args.k}-n{args.steps}{suffix}")
        if args.collect and not (out / "report.json").exists():
            continue
        row = run_one(method, args.steps, args.lr, args.seed, args.k, args.extra, out, collect=args.collect)
        if row is None:
            print(f"{out}: not tabulated, its run had other options (a default changed since?)")
            continue
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "config"}))
        write_results(args, rows)
    print(f"wrote {Path(args.results).with_suffix('.md')} and {Path(args.results).with_suffix('.json')}")


def run_options(method: str, steps: int, lr: float, seed: int, k: int, extra: Dict[str, str], out) -> Dict:
    """The options of the `adept-ext run` of `method` into `out` (`config_from`'s input): the
    comparison's budget, and `extra` (option name -> text, as `--set` gives it) converted to each
    option's type."""
    options = dict(method=method, steps=steps, lr=lr, seed=seed, k=k, warmup_steps=max(1, steps // 10),
                   eval_every=0, save_every=0, out=str(out), overwrite=True)
    return {**options, **typed_options(RunConfig(), extra)}


@functools.lru_cache(maxsize=None)
def default_options(method: str) -> Dict:
    """`result_options` of `adept-ext run --method METHOD` with every other option at its default."""
    return result_options(config_from({"method": method}))


def run_one(method: str, steps: int, lr: float, seed: int, k: int, extra: Dict[str, str], out: Path,
            collect: bool = False) -> Optional[Dict]:
    """One `adept-ext run` of `method` into `out` as a result row: general Δloss (forgetting), domain
    Δloss (gain), trainable fraction, layers, the training's tokens/s and peak memory (on the CPU the
    process's peak resident memory so far: a later method of one call reads at least an earlier
    one's), the benchmark difference ({task: {metric: {base, final, delta, stderr, beyond_2se}}}, {}
    without --benchmarks) and "config", the run's resolved configuration (`result_options`). With
    `collect`, the row of the finished report.json in `out` instead: its recorded configuration as it
    reads today (`as_recorded_today`: an option added since at its default), and None where that
    differs from the one this call would run."""
    cfg = config_from(run_options(method, steps, lr, seed, k, extra, out))
    wanted = result_options(cfg)
    if collect:
        report = json.loads((out / "report.json").read_text())
        config = as_recorded_today(report["config"], default_options(method))
        if config != wanted:
            return None
    else:
        report, config = run(cfg, progress=False), wanted
    return {"method": method, "general_delta": report["forgetting_general_delta"],
            "domain_delta": -report["gain_domain_delta"], "trainable_fraction": report["trainable_fraction"],
            "wall_seconds": report["wall_seconds"], "layers": report["layers"],
            "base": report["base"], "final": report["final"],
            "mean_lr_multiplier": report.get("unit_rates", {}).get("mean_multiplier"),
            "tokens_per_second": report.get("stages", {}).get("train", {}).get("tokens_per_second"),
            "peak_memory_mb": report.get("stages", {}).get("train", {}).get("peak_memory_mb"),
            "benchmarks": report.get("benchmarks", {}).get("difference", {}), "config": config}


def benchmark_columns(rows: List[Dict]) -> List[str]:
    """The benchmark metrics of the rows as (task, metric) pairs, in first-seen order."""
    return list(dict.fromkeys((task, metric) for r in rows for task, metrics in r.get("benchmarks", {}).items()
                              for metric in metrics))


def benchmark_cell(row: Dict, task: str, metric: str) -> str:
    """"final (Δ vs base, se S, paired p P)" of one benchmark metric of a row, P McNemar's (marked * where
    the paired test calls the change real at 5 %); – where its run did not score it."""
    c = row.get("benchmarks", {}).get(task, {}).get(metric)
    if c is None:
        return "–"
    paired = c.get("paired") or {}
    return (f"{c['final']:.4f} ({c['delta']:+.4f}" + ("" if c["stderr"] is None else f", se {c['stderr']:.4f}")
            + ("" if paired.get("p_value") is None else f", paired p {paired['p_value']:.2g}")
            + (" *" if paired.get("significant") else "") + ")")


def write_results(args, rows):
    budget = {"steps": args.steps, "batch": "4 x 128 tokens", "tokens": args.steps * 4 * 128, "lr": args.lr,
              "seed": args.seed, "k": args.k, **args.extra, "model": "smollm2-135m", "general": "bbc-news",
              "domain": "python-docs"}
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"budget": budget, "methods": rows}, indent=2))
    columns = benchmark_columns(rows)
    lines = ["# Method comparison on the embedded default", "",
             f"SmolLM2-135M, general = BBC News (held out), domain = Python docs (held out); {args.steps} steps of "
             f"4 x 128 tokens ({budget['tokens']} tokens), AdamW lr {args.lr} (warmup + cosine), seed {args.seed}, "
             f"k = {args.k}"
             + "".join(f", {key} = {value}" for key, value in args.extra.items()) + ".",
             "Forgetting = general held-out Δloss (lower is better); gain = domain held-out Δloss (more negative is "
             "better); KL to base = the final model's mean KL from the base's next-token distributions on held-out "
             "general positions (--drift-tokens)."
             + (" Benchmarks (lm-eval): the final model's value (its change from the base model, the stderr of "
                "that change with the two scores taken as independent, and McNemar's paired p on the same items; "
                "* = real by the paired test at 5 %)." if columns else ""), "",
             "| method | general Δloss (forgetting) | domain Δloss (gain) | KL to base | trainable | wall s "
             "| train tokens/s | peak memory MB | layers |"
             + "".join(f" {task} {metric} |" for task, metric in columns),
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(columns)]
    lines += [f"| {r['method']} | {r['general_delta']:+.4f} | {r['domain_delta']:+.4f} | "
              + (f"{r['final']['kl_to_base']:.4f}" if "kl_to_base" in r.get("final", {}) else "–") + " | "
              f"{r['trainable_fraction']:.1%} | {r['wall_seconds']} | {r.get('tokens_per_second') or '–'} | "
              f"{r.get('peak_memory_mb') or '–'} | {r['layers']} |"
              + "".join(f" {benchmark_cell(r, task, metric)} |" for task, metric in columns) for r in rows]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
