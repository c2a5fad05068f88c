"""The runners' report.md: what `adept-ext run` (`run_markdown`) and `adept-ext continual`
(`sequence_markdown`) measured, as tables, from their report.json."""
import math
from typing import Dict, Optional

from ..evaluation import harness


def signed(value: Optional[float]) -> str:
    """`value` with its sign to 4 decimals, or "n/a" (BWT and FWT of a one-task sequence)."""
    return "n/a" if value is None else f"{value:+.4f}"


def run_markdown(report: Dict) -> str:
    """report.md of `adept-ext run` from its report.json (`report`)."""
    cfg, base, final = report["config"], report["base"], report["final"]
    lines = [f"# adept_ext run: {report['method']}", "",
             f"Model `{cfg['model']}`, general corpus `{cfg['general']}`, domain corpus `{cfg['domain']}`; "
             f"{cfg['steps']} steps of {cfg['grad_accum']} micro-batch(es) x {cfg['batch_size']} blocks x "
             f"{cfg['max_length']} tokens, lr {cfg['lr']}, "
             f"seed {cfg['seed']}, device {report['machine']['device']}.", "",
             "| | general loss | general ppl | domain loss | domain ppl |", "|---|---|---|---|---|",
             *(f"| {label} | {r['general_loss']:.4f} | {math.exp(r['general_loss']):.2f} | "
               f"{r['domain_loss']:.4f} | {math.exp(r['domain_loss']):.2f} |" for label, r in (("base", base),
                                                                                              ("final", final))),
             "", f"Forgetting (general Δloss): {report['forgetting_general_delta']:+.4f}; "
             f"gain (domain −Δloss): {report['gain_domain_delta']:+.4f}."
             + ("" if not report.get("evaluated_held") else
                f" Both rows evaluate the model as the steps saw it, its frozen weights held in "
                f"{report['evaluated_held']} (--frozen-dtype); the saved model has them exact.")
             + ("" if "drift" not in report else
                f" Drift from the base: mean KL {report['drift']['kl_to_base']:.4f} nats over "
                f"{report['drift']['tokens']} held-out general positions."), "",
             f"Trainable parameters: {report['trainable_parameters'] / 1e6:.2f}M ({report['trainable_fraction']:.1%}): "
             f"{report['summary']}. Layer numbers are those of the model before expansion unless said otherwise.", "",
             "| stage | seconds | peak memory MB |", "|---|---|---|"]
    lines += [f"| {name} | {s['seconds']} | {s['peak_memory_mb']} |" for name, s in report["stages"].items()]
    estimate = report["memory_estimate_mb"]
    lines += ["", f"The memory check's estimate for the steps: {estimate['total']} MB (weights {estimate['weights']}, "
                  f"optimizer {estimate['optimizer']}, activations {estimate['activations']}); the measured peak "
                  "is the process's resident set on the CPU (Python and its libraries included), allocated memory "
                  "on a GPU."]
    if "merge_back" in report:
        mb = report["merge_back"]
        lines += ["", f"Merged back toward the start at α = {mb['alpha']:g} ({mb['schedule']}"
                      + (f", bottom α {mb['alpha_min']:g}" if mb["schedule"] == "lines" else "")
                      + (f"; chosen by auto as the largest α whose general Δloss is at most {mb['max_forgetting']:g}"
                         if "max_forgetting" in mb else "") + "): the final row is the merged model; trained "
                      f"(α = 1 before finishing): general {mb['trained']['general_loss']:.4f}, domain "
                      f"{mb['trained']['domain_loss']:.4f}.", "", "| α | general Δloss | domain Δloss |",
                  "|---|---|---|",
                  *(f"| {p['alpha']:g} | {p['general_delta']:+.4f} | {p['domain_delta']:+.4f} |" for p in mb["front"])]
    if "unit_rates" in report:
        lines += ["", f"Per-unit learning-rate multipliers (mean {report['unit_rates']['mean_multiplier']:.3f}, "
                      f"{report['unit_rates']['recomputes']} recomputes): see `unit_rates.png`."]
    if "benchmarks" in report:
        lines += ["", "Benchmarks (lm-evaluation-harness, base vs final; docs/evaluation.md):", "",
                  harness.comparison_table(report["benchmarks"]["difference"]).rstrip()]
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in report["plots"]) + "."]
    return "\n".join(lines) + "\n"


def sequence_markdown(report: Dict) -> str:
    """report.md of `adept-ext continual` from its report.json (`report`)."""
    cfg, m = report["config"], report["metrics"]
    names = [t["name"] for t in report["tasks"]]
    lines = [f"# adept_ext continual run: {report['method']}", "",
             f"Model `{cfg['model']}`, tasks {' → '.join(names)}, general corpus `{cfg['general']}` (held out); "
             f"{cfg['steps']} steps per task of {cfg['grad_accum']} micro-batch(es) x {cfg['batch_size']} blocks x "
             f"{cfg['max_length']} tokens, lr {cfg['lr']}, seed {cfg['seed']}, "
             f"device {report['machine']['device']}.", "",
             "Score a[t][i] = accuracy (instruction tasks: exact match of the greedy answer) or −loss (text tasks: "
             "held-out next-token loss) on task i after training through task t.", "",
             "| after | " + " | ".join(f"{n} ({t['metric']})" for n, t in zip(names, report["tasks"]))
             + " | general loss |",
             "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {r['label']} | " + " | ".join(f"{s:.4f}" for s in r["scores"]) + f" | {r['general_loss']:.4f} |"
              for r in report["rows"]]
    lines += ["", f"AA {m['AA']:.4f}; BWT {signed(m['BWT'])}; FWT {signed(m['FWT'])}; general forgetting "
                  f"(general loss after the last task − base) {report['general_forgetting']:+.4f}"
                  + ("." if "kl_to_base" not in report else
                     f"; drift from the base (mean KL on held-out general positions) "
                     f"{', '.join(f'{kl:.4f}' for kl in report['kl_to_base'][1:])} after each task."), "",
              "| task | what trained | trainable parameters | seconds | peak memory MB |", "|---|---|---|---|---|"]
    lines += [f"| {p['task']} | {p['summary']} | {p['trainable_parameters'] / 1e6:.2f}M | {p['seconds']} | "
              f"{p['peak_memory_mb']} |" for p in report["per_task"]]
    scored = [(r["label"], r["benchmarks"]) for r in report["rows"] if "benchmarks" in r]
    if scored:
        lines += ["", "Benchmarks (lm-evaluation-harness, value ± stderr; docs/evaluation.md):", "",
                  harness.rows_table(scored).rstrip(), "", "Base model vs after the last task:", "",
                  harness.comparison_table(report["benchmark_difference"]).rstrip()]
    lines += ["", f"Wall time {report['wall_seconds']} s. Plots: `matrix.png`, `general.png`."]
    return "\n".join(lines) + "\n"
