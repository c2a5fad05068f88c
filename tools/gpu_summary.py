#!/usr/bin/env python
"""Merge the outputs of tools/gpu_check.sh into ONE JSON summary: every step's status and time,
the test and sanitizer counts, every benchmark's full results, the headline figures of issue 11
and whether its goals were met.

    python tools/gpu_summary.py OUT_DIR [--budget-s S] [--elapsed-s S]    (writes OUT_DIR/summary.json)

Standard library only, so that it runs whatever broke before it. Exit status 0 when every step
in OUT_DIR/steps.tsv is ok (or was not asked for), 1 otherwise; a goal not met is reported, not
a failure.
"""
import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

# Goals of issue 11 (the numbers its "What to build" asks for).
GOALS = {
    "3_linear_ce": "default chunking <= 1.0x the time of each installed peer, <= 256 MB extra, >= 0.8 of the GEMM rate",
    "4_probe": ">= 1.6x the naive loop at <= 1/5 of its peak memory, on both shapes",
    "5_taylor_importance": ">= 0.9 of the bandwidth probe at the 1B scale, >= 0.75 at 63M, both dtypes",
    "6_projection": ">= 1.0x cached-basis torch at 19.3M for every k, >= 0.85 of nominal bandwidth at 487M",
    "7_recompute": "recompute in the training's precision >= 3x faster than the fp32 one",
    "8_step_overhead": "per-unit groups <= 1% step overhead",
    "26_train_step": "full step at the Llama-3.2-1B shape, 8 x 4096 tokens: fused loss <= 0.8x the Trainer's peak "
                     "memory at >= 1.0x its tokens/s, with checkpointing <= 0.4x; >= 1.0x Liger's tokens/s at <= its "
                     "peak memory (when installed)",
}


def read_steps(out):
    steps = {}
    path = os.path.join(out, "steps.tsv")
    if not os.path.exists(path):
        return steps
    with open(path) as f:
        for line in f:
            name, status, rc, seconds, log = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
            step = {"status": status, "rc": int(rc), "seconds": int(seconds), "log": log}
            if status not in ("ok", "not requested") and log and os.path.exists(os.path.join(out, "logs", log)):
                with open(os.path.join(out, "logs", log), errors="replace") as g:
                    step["log_tail"] = g.read().splitlines()[-40:]
            steps[name] = step
    return steps


def read_junit(path):
    """pytest's --junitxml: counts and the ids of the failed tests."""
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_ids"] = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                            if c.find("failure") is not None or c.find("error") is not None]
    return counts


def read_sanitizer(out, step):
    """The ERROR SUMMARY line of a compute-sanitizer log and pytest's last line."""
    path = os.path.join(out, "logs", f"{step}.log")
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        text = f.read()
    m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    pytest_line = next((line.strip() for line in reversed(text.splitlines())
                        if re.search(r"\b\d+ (passed|failed)\b", line)), None)
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text)
    return {"errors": int(m[-1]) if m else None, "hazards": int(hazards[-1]) if hazards else None,
            "pytest": pytest_line, "first_report": next((line for line in text.splitlines()
                                                         if line.startswith("========= ")
                                                         and ("Invalid" in line or "Race reported" in line)), None)}


def read_bench(out):
    bench = {}
    folder = os.path.join(out, "bench")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                bench[name[:-len(".json")]] = read_json(os.path.join(folder, name))
    return bench


def read_json(path):
    """A JSON file's content; None when it is missing, or its text when it is not JSON."""
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError:
        return {"unreadable": text[-2000:]}


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def all_of(values):
    values = [v for v in values if v is not None]
    return all(values) if values else None


def figures_and_goals(bench):
    """Headline figures (the rows of issue 11's table) and the goals' verdicts (None: not measured)."""
    fig, goals = {}, {}
    lce = get(bench, "linear_ce_large", "linear_ce")
    if lce:
        prov = lce["providers"]
        fig["linear_ce"] = {name: {k: r.get(k) for k in ("s", "peak_mem_mb", "gemm_fraction", "time_vs_adept_ext",
                                                          "rel_diff_loss_sum", "error") if k in r}
                            for name, r in prov.items()}
        fig["linear_ce"]["gemm_s"] = lce["gemm_s"]
        ours = prov.get("adept_ext", {})
        peers = [r["s"] for name, r in prov.items() if name in lce.get("peers_installed", []) and "s" in r]
        goals["3_linear_ce"] = all_of([ours.get("s", float("inf")) <= min(peers) if peers else None,
                                       ours.get("peak_mem_mb", float("inf")) <= 256,
                                       ours.get("gemm_fraction", 0) >= 0.8])
    probe = get(bench, "probe_large", "probe")
    if probe:
        fig["probe"] = {name: {k: r.get(k) for k in ("naive_s", "fused_s", "speedup_vs_naive", "peak_mem_naive_mb",
                                                     "peak_mem_fused_mb", "memory_fraction_of_naive",
                                                     "flop_ratio_bound", "max_rel_diff_variant_losses")}
                        for name, r in probe.items()}
        goals["4_probe"] = all_of([r["speedup_vs_naive"] >= 1.6 and r["memory_fraction_of_naive"] <= 0.2
                                   for r in probe.values()])
    verdicts = []
    for size, floor in (("small", 0.75), ("large", 0.9)):
        imp = get(bench, f"importance_{size}", "importance")
        if imp:
            fig[f"taylor_importance_{size}"] = {dt: {k: r.get(k) for k in ("elements", "fused_s", "fused_gbps",
                                                                            "bandwidth_fraction", "speedup_vs_naive",
                                                                            "speedup_vs_foreach")}
                                                for dt, r in imp.items()}
            verdicts += [r["bandwidth_fraction"] >= floor for r in imp.values()]
    goals["5_taylor_importance"] = all_of(verdicts) if verdicts else None
    verdicts = []
    for size in ("small", "large"):
        proj = get(bench, f"projection_{size}", "projection")
        if proj:
            keys = ("fused_s", "torch_cached_s", "speedup_vs_torch_cached", "fused_gbps", "nominal_bandwidth_fraction",
                    "extra_peak_mb_fused")
            fig[f"projection_{size}"] = {k: {m: r.get(m) for m in keys} for k, r in proj["by_k"].items()}
            if "fixed_cost" in proj:  # the per-call host and launch cost, whatever the size
                fig[f"projection_{size}"]["fixed_cost"] = proj["fixed_cost"]
            if size == "small":
                verdicts += [r["speedup_vs_torch_cached"] >= 1.0 for r in proj["by_k"].values()]
            else:
                fractions = [r.get("nominal_bandwidth_fraction") for r in proj["by_k"].values()]
                verdicts += [None if f is None else f >= 0.85 for f in fractions]  # None: GPU not in the table
    goals["6_projection"] = all_of(verdicts) if verdicts else None
    lr = get(bench, "lr_large", "lr")
    if lr:
        fig["lr"] = {k: lr.get(k) for k in ("plain_step_s", "decoupled_step_s", "adamw_groups_step_overhead",
                                            "grouped_step_s", "step_overhead", "recompute_fused_s",
                                            "recompute_fused_autocast_s", "recompute_plain_autocast_s",
                                            "recompute_autocast_speedup_vs_fp32")}
        speedup = lr.get("recompute_autocast_speedup_vs_fp32")
        goals["7_recompute"] = None if speedup is None else speedup >= 3
        goals["8_step_overhead"] = lr["step_overhead"] <= 0.01
    step = get(bench, "train_step_large", "train_step")
    if step:
        full = step["methods"]["full"]
        fig["train_step"] = full
        ours, liger = full.get("adept_ext", {}), full.get("trainer_liger")
        goals["26_train_step"] = all_of([
            ours.get("peak_memory_vs_trainer", 1) <= 0.8, ours.get("tokens_per_s_vs_trainer", 0) >= 1.0,
            full.get("adept_ext+checkpointing", {}).get("peak_memory_vs_trainer", 1) <= 0.4,
            None if liger is None else (ours["tokens_per_s"] >= liger["tokens_per_s"]
                                        and ours["peak_memory_mb"] <= liger["peak_memory_mb"])])
    return fig, {k: {"goal": GOALS[k], "met": goals.get(k)} for k in GOALS}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--budget-s", type=int)
    parser.add_argument("--elapsed-s", type=int)
    args = parser.parse_args(argv)
    steps = read_steps(args.out)
    failed = [name for name, s in steps.items() if s["status"] not in ("ok", "not requested")]
    machine_path = os.path.join(args.out, "machine.json")
    bench = read_bench(args.out)
    figures, goals = figures_and_goals(bench)
    summary = {
        "ok": not failed and bool(steps), "failed_steps": failed,
        "budget_s": args.budget_s, "elapsed_s": args.elapsed_s,
        "machine": read_json(machine_path),
        "steps": steps,
        "tests": read_junit(os.path.join(args.out, "logs", "tests.xml")),
        "memcheck": read_sanitizer(args.out, "memcheck"),
        "racecheck": read_sanitizer(args.out, "racecheck"),
        "figures": figures, "goals": goals, "bench": bench,
    }
    path = os.path.join(args.out, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {path}")
    for name, g in goals.items():
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        print(f"goal {name}: {verdict} ({g['goal']})")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
