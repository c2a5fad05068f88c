#!/usr/bin/env python
"""Does the drift signal track forgetting? Over the runs of tools/compare_methods.py's results (one JSON
per seed), the final model's KL to the base (`--drift-tokens`, docs/evaluation.md) against its general
held-out Δloss and, where the runs scored a benchmark, that benchmark's change: Pearson's r and
Spearman's ρ with their p-values (scipy), and each run's values, as JSON and markdown.

    python tools/drift_correlation.py RESULTS.json [RESULTS.json ...] [--benchmark adept_general]
                                      [--metric acc] [--out docs/results/drift]
"""
import argparse
import json
from pathlib import Path
from typing import Dict, List

from scipy import stats


def points(results: List[Dict], benchmark: str, metric: str) -> List[Dict]:
    """One point per run that has the KL: method, seed, KL, general Δloss, the benchmark metric's Δ (or None)."""
    out = []
    for result in results:
        seed = result["budget"]["seed"]
        for row in result["methods"]:
            kl = row.get("final", {}).get("kl_to_base")
            if kl is None:
                continue
            change = row.get("benchmarks", {}).get(benchmark, {}).get(metric)
            out.append({"method": row["method"], "seed": seed, "kl_to_base": kl,
                        "general_delta": row["general_delta"], "domain_delta": row["domain_delta"],
                        "benchmark_delta": None if change is None else change["delta"]})
    return out


def correlation(x: List[float], y: List[float]) -> Dict:
    """Pearson's r and Spearman's ρ of x and y with their two-sided p-values, and n."""
    pearson, spearman = stats.pearsonr(x, y), stats.spearmanr(x, y)
    return {"n": len(x), "pearson_r": float(pearson.statistic), "pearson_p": float(pearson.pvalue),
            "spearman_rho": float(spearman.statistic), "spearman_p": float(spearman.pvalue)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="compare_methods results JSON files")
    parser.add_argument("--benchmark", default="adept_general")
    parser.add_argument("--metric", default="acc")
    parser.add_argument("--out", default="docs/results/drift", help="path prefix of the .json and .md written")
    args = parser.parse_args(argv)
    rows = points([json.loads(Path(p).read_text()) for p in args.results], args.benchmark, args.metric)
    if len(rows) < 3:
        raise SystemExit(f"{len(rows)} runs with a KL to the base: a correlation needs at least 3")
    kl = [r["kl_to_base"] for r in rows]
    against = {"general_delta": correlation(kl, [r["general_delta"] for r in rows]),
               "domain_delta": correlation(kl, [r["domain_delta"] for r in rows])}
    scored = [r for r in rows if r["benchmark_delta"] is not None]
    if len(scored) >= 3:
        against[f"{args.benchmark}_{args.metric}_delta"] = correlation(
            [r["kl_to_base"] for r in scored], [r["benchmark_delta"] for r in scored])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"runs": rows, "correlation": against}, indent=2))
    lines = ["| quantity | n | Pearson r (p) | Spearman ρ (p) |", "|---|---|---|---|"]
    lines += [f"| {name} | {c['n']} | {c['pearson_r']:+.2f} ({c['pearson_p']:.2g}) | "
              f"{c['spearman_rho']:+.2f} ({c['spearman_p']:.2g}) |" for name, c in against.items()]
    lines += ["", f"| method | seed | KL to base | general Δloss | domain Δloss | {args.benchmark} {args.metric} Δ |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['seed']} | {r['kl_to_base']:.4f} | {r['general_delta']:+.4f} | "
              f"{r['domain_delta']:+.4f} | " + ("–" if r["benchmark_delta"] is None else f"{r['benchmark_delta']:+.4f}")
              + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
