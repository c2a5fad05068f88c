#!/usr/bin/env python
"""The merge-back front beside the other methods: for each seed, the front of a `--merge-back auto` run
(report.json's merge_back.front: α → general and domain Δloss from the base) and the points of the
methods in tools/compare_methods.py's results of that seed; which α, if any, gains at least as much as
each of the named methods while forgetting no more (beyond the seeds' spread: the difference of the
means must exceed the sum of the two spreads to count). Writes PATH.md, PATH.json and PATH.png.

    python tools/merge_front.py --runs RUN_DIR[,RUN_DIR] --results RESULTS.json[,RESULTS.json]
                                [--methods adept,llama_pro,lora] [--out docs/results/merge-front]
"""
import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List



def spread(values: List[float]) -> float:
    """Half the range over the seeds (0 for one seed)."""
    return (max(values) - min(values)) / 2


def mean_front(fronts: List[List[Dict]]) -> List[Dict]:
    """Per α (the runs share the grid): the mean and spread over seeds of general and domain Δloss."""
    by_alpha: Dict[float, List[Dict]] = {}
    for front in fronts:
        for point in front:
            by_alpha.setdefault(point["alpha"], []).append(point)
    return [{"alpha": a, "general_delta": statistics.mean(p["general_delta"] for p in ps),
             "general_spread": spread([p["general_delta"] for p in ps]),
             "domain_delta": statistics.mean(p["domain_delta"] for p in ps),
             "domain_spread": spread([p["domain_delta"] for p in ps]), "seeds": len(ps)}
            for a, ps in sorted(by_alpha.items())]


def method_points(results: List[Dict], names: List[str]) -> List[Dict]:
    """The named methods' mean and spread over the results' seeds of general and domain Δloss."""
    out = []
    for name in names:
        rows = [r for result in results for r in result["methods"] if r["method"] == name]
        if rows:
            out.append({"method": name, "general_delta": statistics.mean(r["general_delta"] for r in rows),
                        "general_spread": spread([r["general_delta"] for r in rows]),
                        "domain_delta": statistics.mean(r["domain_delta"] for r in rows),
                        "domain_spread": spread([r["domain_delta"] for r in rows]), "seeds": len(rows)})
    return out


def dominates(point: Dict, method: Dict) -> bool:
    """`point` gains at least as much (domain Δloss no higher) and forgets no more (general Δloss no higher)
    than `method`, neither worse beyond the two spreads."""
    return (point["domain_delta"] - method["domain_delta"] <= point["domain_spread"] + method["domain_spread"]
            and point["general_delta"] - method["general_delta"] <= point["general_spread"] + method["general_spread"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="comma-separated run directories of --merge-back auto runs")
    parser.add_argument("--results", required=True, help="comma-separated compare_methods results JSON files")
    parser.add_argument("--methods", default="adept,llama_pro,lora")
    parser.add_argument("--out", default="docs/results/merge-front")
    args = parser.parse_args(argv)
    reports = [json.loads((Path(d) / "report.json").read_text()) for d in args.runs.split(",")]
    front = mean_front([r["merge_back"]["front"] for r in reports])
    chosen = [r["merge_back"]["alpha"] for r in reports]
    methods = method_points([json.loads(Path(p).read_text()) for p in args.results.split(",")],
                            args.methods.split(","))
    for point in front:
        point["at_least_as_good_as"] = [m["method"] for m in methods if dominates(point, m)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"front": front, "auto_alpha": chosen, "methods": methods,
                                                    "method_of_front": reports[0]["method"]}, indent=2))
    lines = ["| α | general Δloss | domain Δloss | at least as good as (within the spreads) |", "|---|---|---|---|"]
    lines += [f"| {p['alpha']:g} | {p['general_delta']:+.4f} ± {p['general_spread']:.4f} | "
              f"{p['domain_delta']:+.4f} ± {p['domain_spread']:.4f} | {', '.join(p['at_least_as_good_as']) or '–'} |"
              for p in front]
    lines += ["", "| method | general Δloss | domain Δloss |", "|---|---|---|"]
    lines += [f"| {m['method']} | {m['general_delta']:+.4f} ± {m['general_spread']:.4f} | "
              f"{m['domain_delta']:+.4f} ± {m['domain_spread']:.4f} |" for m in methods]
    lines += ["", f"`auto` chose α = {', '.join(f'{a:g}' for a in chosen)} (one per seed)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    ax.errorbar([p["general_delta"] for p in front], [p["domain_delta"] for p in front],
                xerr=[p["general_spread"] for p in front], yerr=[p["domain_spread"] for p in front], marker="o",
                color="tab:blue", label=f"{reports[0]['method']} merged back, α = 0 … 1")
    for p in front:
        ax.annotate(f"{p['alpha']:g}", (p["general_delta"], p["domain_delta"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 3))
    for m in methods:
        ax.errorbar([m["general_delta"]], [m["domain_delta"]], xerr=[m["general_spread"]], yerr=[m["domain_spread"]],
                    marker="s", linestyle="none", label=m["method"])
    ax.axvline(0, color="grey", lw=0.6)
    ax.set_xlabel("general held-out Δloss (forgetting)")
    ax.set_ylabel("domain held-out Δloss (gain: lower is better)")
    ax.legend(fontsize=8)
    ax.set_title("merging back vs the methods (mean ± half range over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
