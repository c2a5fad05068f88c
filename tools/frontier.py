#!/usr/bin/env python
"""The forgetting–gain frontier: every method (and ADEPT with each Stage 1 placement) over
learning rates and seeds on the embedded default, one `adept-ext run` per point. Writes
docs/results/frontier.md/.json and frontier.png (general Δloss = forgetting on x, domain Δloss
= gain on y, one marker per method, a line joining a method's learning rates per seed).

    python tools/frontier.py [--lrs 3e-4,1e-3] [--seeds 0,1] [--steps 100]
                             [--methods adept,adept:placement=spread,llama_pro,...]
                             [--set OPTION=VALUE ...] [--shard 0/2] [--collect]

A point is reused, not rerun (the runner is deterministic on the CPU), when a recorded run has its
resolved configuration: `training.result_options` of the config the point would run (every option
that changes results, defaults included, the method's own options alone; not where it writes or
how often it checkpoints or logs), which its row records as "config". The recorded runs are a
finished run directory in --out, a row of docs/results/compare*.json (tools/compare_methods.py) and
a point of an earlier frontier JSON at --results, so an interrupted frontier resumes and `--collect`
redraws the table and figure from the JSON alone. A run recorded under other options, a changed
default among them, is not reused; rows and points recorded before configurations were (without
"config") never are, and their number is printed.
`--shard I/N` runs every N-th point that no comparison JSON holds (parallel lanes);
`--collect` runs nothing and tabulates what exists (writing nothing when no point is
reusable, so stale results stay). About 4 minutes per point on 2 CPU cores.
"""
import argparse
import glob
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from adept_ext.train import METHODS, config_from
from adept_ext.training import as_recorded_today, result_options
from compare_methods import default_options, run_one, run_options

PLACEMENT_VARIANTS = [f"adept:placement={p}" for p in ("uniform", "domain_aware", "plasticity", "depth", "spread")]
DEFAULT_METHODS = ["adept"] + PLACEMENT_VARIANTS + ["llama_pro", "lora", "full"]
# The published comparisons and frontier (docs/results.md) ran while --probe-blocks defaulted to 8
# (it is 4 now, for the demo): the frontier passes 8 unless told otherwise, so a rerun is that setting.
PUBLISHED_OPTIONS = {"probe_blocks": "8"}
BASELINES = ("llama_pro", "lora")  # what a placement must dominate to become the default


def parse_method(text: str) -> Dict:
    """"adept:placement=spread,lr_floor=0" -> {"label", "method", "options"}."""
    method, _, rest = text.partition(":")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    label = method + "".join(f" {v}" if k == "placement" else f" {k}={v}" for k, v in options.items())
    return {"label": label, "method": method, "options": options}


def config_key(config: Dict) -> str:
    """A resolved configuration (`result_options`, or a row's recorded "config") as a dict key."""
    return json.dumps(config, sort_keys=True)


def wanted_config(args, variant: Dict, lr: float, seed: int, extra: Dict) -> Dict:
    """The resolved configuration of the run of `variant` at `lr` and `seed` (`result_options`)."""
    return result_options(config_from(run_options(variant["method"], args.steps, lr, seed, args.k,
                                                  {**extra, **variant["options"]}, point_dir(args, variant, lr, seed))))


def by_config(rows: List[Dict]) -> Tuple[Dict, int]:
    """({config_key: row} of the rows that record their configuration, how many do not)."""
    found = {}
    for row in rows:
        if "config" in row and row["config"].get("method") in METHODS:  # a method still offered
            found[config_key(as_recorded_today(row["config"], default_options(row["config"]["method"])))] = row
    return found, sum("config" not in row for row in rows)


def reusable(paths: List[str]) -> Tuple[Dict, int]:
    """({config_key: row} of the rows of earlier comparison JSONs (each with its "source"), how many
    rows record no configuration)."""
    return by_config([{**row, "source": path} for path in paths
                      for row in json.loads(Path(path).read_text())["methods"]])


def earlier_frontier(path: Path) -> Tuple[Dict, int]:
    """({config_key: point} of the frontier JSON at `path` (its label, lr and seed left out), how many
    points record no configuration); ({}, 0) when there is none."""
    if not path.exists():
        return {}, 0
    return by_config([{key: v for key, v in p.items() if key not in ("label", "lr", "seed")}
                      for p in json.loads(path.read_text())["points"]])


def frontier_budget(args, extra: Dict, lrs, seeds) -> Dict:
    return {"steps": args.steps, "batch": "4 x 128 tokens", "tokens": args.steps * 4 * 128, "lrs": lrs, "seeds": seeds,
            "k": args.k, **extra, "model": "smollm2-135m", "general": "bbc-news", "domain": "python-docs"}


def point_dir(args, variant: Dict, lr: float, seed: int) -> Path:
    slug = variant["method"] + "".join(f"-{k}{v}" for k, v in variant["options"].items())
    return Path(args.out) / f"{slug}-lr{lr}-s{seed}-k{args.k}-n{args.steps}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lrs", default="3e-4,1e-3")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--methods", default=";".join(DEFAULT_METHODS),
                        help="';'-separated METHOD[:OPTION=VALUE,...] (default: adept with every placement, "
                             "llama_pro, lora, full)")
    parser.add_argument("--set", action="append", default=[f"{k}={v}" for k, v in PUBLISHED_OPTIONS.items()],
                        metavar="OPTION=VALUE", help="a run option for every point (default: probe_blocks=8, the "
                                                     "published setting; a later --set probe_blocks=N overrides it)")
    parser.add_argument("--reuse", default="docs/results/compare*.json", help="glob of earlier comparison JSONs")
    parser.add_argument("--out", default="runs/frontier", help="run directories (one per point)")
    parser.add_argument("--results", default="docs/results/frontier", help="path prefix of .md, .json and .png")
    parser.add_argument("--shard", default="0/1",
                        help="I/N: run only every N-th point to run, from the I-th (parallel lanes)")
    parser.add_argument("--collect", action="store_true", help="run nothing: tabulate the points that exist")
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.set)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = [parse_method(m) for m in args.methods.split(";") if m]
    old, old_unkeyed = reusable(sorted(glob.glob(args.reuse)))
    earlier, earlier_unkeyed = earlier_frontier(Path(args.results).with_suffix(".json"))
    if old_unkeyed or earlier_unkeyed:
        print(f"not reused: {old_unkeyed} comparison row(s) and {earlier_unkeyed} earlier frontier point(s) recorded "
              f"without their configuration (before configurations were recorded)")
    shard, shards = map(int, args.shard.split("/"))
    points, to_run = [], 0
    for lr in lrs:
        for seed in seeds:
            for variant in variants:
                key = config_key(wanted_config(args, variant, lr, seed, extra))
                if key not in old:
                    to_run += 1  # lanes split the points not in earlier comparison JSONs by this fixed count
                    if not args.collect and (to_run - 1) % shards != shard:
                        continue
                row = find_point(args, variant, lr, seed, extra, old.get(key) or earlier.get(key))
                if row is None and not args.collect:
                    row = run_one(variant["method"], args.steps, lr, seed, args.k, {**extra, **variant["options"]},
                                  point_dir(args, variant, lr, seed))
                    row["source"] = str(point_dir(args, variant, lr, seed))
                    earlier[key] = row  # another label of this configuration (a default spelt out) reuses it
                    print(json.dumps({"label": variant["label"], "lr": lr, "seed": seed,
                                      "general_delta": row["general_delta"], "domain_delta": row["domain_delta"]}))
                if row is not None:
                    points.append({"label": variant["label"], "lr": lr, "seed": seed, **row})
    if not args.collect and shards > 1:
        print(f"shard {shard}/{shards} done; tabulate all lanes with --collect")
        return
    if not points:  # nothing reusable (--collect): keep the results there are
        print("no point to tabulate: nothing written")
        return
    write_results(args, extra, lrs, seeds, variants, points)


def find_point(args, variant: Dict, lr: float, seed: int, extra: Dict, recorded: Optional[Dict]) -> Optional[Dict]:
    """A finished point of this configuration: its run directory in --out when that run had it,
    else `recorded` (the row of an earlier comparison or frontier JSON with it, or None)."""
    out = point_dir(args, variant, lr, seed)
    if (out / "report.json").exists():
        row = run_one(variant["method"], args.steps, lr, seed, args.k, {**extra, **variant["options"]}, out,
                      collect=True)
        if row is not None:
            return {**row, "source": str(out)}
    return recorded


def dominance(points: List[Dict], lrs, seeds) -> List[Dict]:
    """For every ADEPT variant and learning rate: on which seeds it dominates each baseline at
    that learning rate (gain ≥ the baseline's and forgetting ≤ the baseline's)."""
    at = {(p["label"], p["lr"], p["seed"]): p for p in points}
    verdicts = []
    for label in dict.fromkeys(p["label"] for p in points if p["method"].startswith("adept")):
        for lr in lrs:
            row = {"label": label, "lr": lr}
            for base in BASELINES:
                wins = [s for s in seeds if (label, lr, s) in at and (base, lr, s) in at
                        and at[(label, lr, s)]["domain_delta"] <= at[(base, lr, s)]["domain_delta"]
                        and at[(label, lr, s)]["general_delta"] <= at[(base, lr, s)]["general_delta"]]
                measured = [s for s in seeds if (label, lr, s) in at and (base, lr, s) in at]
                row[base] = {"dominates_on_seeds": wins, "measured_seeds": measured}
            row["dominates_all"] = all(row[b]["measured_seeds"] == seeds and row[b]["dominates_on_seeds"] == seeds
                                       for b in BASELINES)
            verdicts.append(row)
    return verdicts


def write_results(args, extra, lrs, seeds, variants, points):
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    budget = frontier_budget(args, extra, lrs, seeds)
    verdicts = dominance(points, lrs, seeds)
    path.with_suffix(".json").write_text(json.dumps({"budget": budget, "points": points, "dominance": verdicts},
                                                    indent=2))
    plot(points, variants, path.with_suffix(".png"))
    at = {(p["label"], p["lr"], p["seed"]): p for p in points}
    lines = ["# Forgetting–gain frontier on the embedded default", "",
             f"SmolLM2-135M, general = BBC News (held out), domain = Python docs (held out); {args.steps} AdamW steps "
             f"of 4 x 128 tokens, warmup + cosine, k = {args.k}"
             + "".join(f", {key} = {value}" for key, value in extra.items())
             + f"; learning rates {', '.join(map(str, lrs))}; seeds {', '.join(map(str, seeds))}.",
             "Forgetting = general held-out Δloss (lower is better); gain = domain held-out Δloss (more negative is "
             "better). Each cell: seed values separated by /.", "",
             f"![frontier]({path.with_suffix('.png').name})", "",
             "| method | lr | general Δloss | domain Δloss | layers |", "|---|---|---|---|---|"]
    for variant in variants:
        for lr in lrs:
            cells = [at.get((variant["label"], lr, s)) for s in seeds]
            if not any(cells):
                continue
            def fmt(key):
                return " / ".join("—" if c is None else f"{c[key]:+.4f}" for c in cells)
            layers = " / ".join("—" if c is None else str(c["layers"]) for c in cells)
            lines.append(f"| {variant['label']} | {lr:g} | {fmt('general_delta')} | {fmt('domain_delta')} | {layers} |")
    lines += ["", "Dominance at a matched learning rate (gain ≥ and forgetting ≤ the baseline's), seeds on which it "
              "holds:", "",
              "| ADEPT variant | lr | " + " | ".join(f"vs {b}" for b in BASELINES) + " |",
              "|---|---|" + "---|" * len(BASELINES)]
    for v in verdicts:
        lines.append(f"| {v['label']} | {v['lr']:g} | " + " | ".join(
            f"{v[b]['dominates_on_seeds'] or 'none'} of {v[b]['measured_seeds']}" for b in BASELINES) + " |")
    sources = sorted({p["source"] for p in points if p["source"].endswith(".json")})
    if sources:
        lines += ["", "Points reused from " + ", ".join(Path(s).name for s in sources)
                  + " (the same resolved configuration)."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path.with_suffix('.md')}, .json and .png ({len(points)} points)")


def plot(points, variants, png: Path, zoom_below: float = 0.15):
    """Two panels: every point, and a zoom on the points that forget less than `zoom_below`
    (the parameter-efficient methods, which the full-training outliers squeeze together)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    markers = "osD^v<>PXh*"
    lrs = sorted({p["lr"] for p in points})
    fig, axes = plt.subplots(1, 2, figsize=(13, 6))
    for ax, zoomed in zip(axes, (False, True)):
        for i, variant in enumerate(variants):
            mine = [p for p in points if p["label"] == variant["label"]]
            colour = f"C{i % 10}"
            for j, seed in enumerate(sorted({p["seed"] for p in mine})):
                run = sorted((p for p in mine if p["seed"] == seed), key=lambda p: p["lr"])
                ax.plot([p["general_delta"] for p in run], [p["domain_delta"] for p in run], color=colour,
                        linestyle="-" if j == 0 else "--", linewidth=1, label=variant["label"] if j == 0 else None)
                for p in run:  # filled marker: the smallest learning rate; hollow: the larger ones
                    ax.plot(p["general_delta"], p["domain_delta"], marker=markers[i % len(markers)], color=colour,
                            markerfacecolor=colour if p["lr"] == lrs[0] else "white", markersize=7)
        ax.axvline(0, color="grey", linewidth=0.5)
        ax.set_xlabel("general Δloss (forgetting; left is better)")
        ax.set_ylabel("domain Δloss (gain; down is better)")
        ax.grid(alpha=0.3)
        if zoomed:
            near = [p for p in points if p["general_delta"] < zoom_below]
            if near:
                xs, ys = [p["general_delta"] for p in near], [p["domain_delta"] for p in near]
                pad_x, pad_y = 0.05 * (max(xs) - min(xs) + 1e-3), 0.05 * (max(ys) - min(ys) + 1e-3)
                ax.set_xlim(min(xs) - pad_x, max(xs) + pad_x)
                ax.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
            ax.set_title(f"zoom: points with general Δloss < {zoom_below}")
        else:
            ax.set_title("every point")
            ax.legend(fontsize=8)
    lr_text = ", ".join(f"{lr:g}" for lr in lrs)
    fig.suptitle(f"Forgetting vs gain. Solid line: seed 0, dashed: seed 1; filled marker: lr {lrs[0]:g}, "
                 f"hollow: the larger lrs (lrs {lr_text})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
