"""The tables of docs/benchmarks.md, rendered from the rows of docs/results/bench.csv.

    python tools/bench.py tables [--csv PATH] [--page PATH] [--check]

Each table stands on the page between `<!-- table: NAME -->` and `<!-- /table -->`: what is
between is rewritten (the table, then a line naming where its rows come from), the prose around
stays. A cell is the value of the last row in the CSV that has the table's, the table row's and
the column's fields; so rows appended by a new run of the same benchmark, size, shape and device
replace the figures they measure again. A table row that no CSV row fills is an error, as is a
cell whose unit is not its column's.
"""
import os
import re
import sys

from bench.common import ROOT, read_csv

CSV = os.path.join(ROOT, "docs", "results", "bench.csv")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def col(header, unit="", **fields):
    return header, unit, fields


def table(where, first, rows, columns):
    """`where`: the fields of every cell; `rows`: (label, fields); `columns`: col(...)s; `first`: the
    header of the label column."""
    return {"where": where, "first": first, "rows": rows, "columns": columns}


def by_provider(*labels):
    """Table rows, one per provider: (label, provider) pairs."""
    return [(label, {"provider": provider}) for label, provider in labels]


CPU_SMALL = {"device": "cpu", "size": "small"}
CPU_QUICK = {"device": "cpu", "size": "small --quick"}
TIME_S, TIMES_NAIVE = col("time s", "s", metric="time"), col("× naive", "x", metric="speedup_vs_naive")
PEAK_MB = col("peak extra MB", "MB", metric="peak_extra_memory")
LENS = "SmolLM2-135M, few-shot BBC topics: "
LR = {**CPU_SMALL, "benchmark": "lr", "shape": "SmolLM2-135M, batch 4x128 Python-docs tokens, 4 copies, 36 units"}


def kernel_columns(*peers, probe=False):
    """A kernel against torch formulations, peers = (label, provider, adept_ext's speed-up metric):
    each one's time and adept_ext's, adept_ext's speed-up over each, its GB/s (and the bandwidth
    probe's), and its bandwidth fraction."""
    return ([col(f"{label} ms", "ms", provider=provider, metric="time")
             for label, provider, _ in (*peers, ("adept_ext", "adept_ext", None))]
            + [col(f"× {label}", "x", provider="adept_ext", metric=metric) for label, _, metric in peers]
            + [col("GB/s", "GB/s", provider="adept_ext", metric="bandwidth")]
            + [col("probe GB/s", "GB/s", provider="bandwidth_probe", metric="bandwidth")] * probe
            + [col("bandwidth fraction", provider="adept_ext", metric="bandwidth_fraction")])


def projection_k(k):
    return f"k = {k}", {"shape": f"96 tensors, 19.3M elements, k {k}"}


def corpus_rows(size_label, megabytes):
    shape = f"{megabytes} MB JSONL corpus, 128-token blocks"
    return [(f"{size_label}: {label}", {"provider": provider, "shape": shape})
            for label, provider in (("in memory", "in_memory"), ("datasets", "datasets"),
                                    ("datasets, cache hit", "datasets_cached"))]


TABLES = {
    "importance": table(
        {**CPU_SMALL, "benchmark": "importance", "shape": "44 tensors, 62.9M elements"}, "dtype",
        [("float32", {"dtype": "float32"}), ("bfloat16", {"dtype": "bfloat16"})],
        kernel_columns(("naive", "torch_naive", "speedup_vs_naive"), ("foreach", "torch_foreach", "speedup_vs_foreach"),
                       probe=True)),
    "probe": table(
        {**CPU_SMALL, "benchmark": "probe", "dtype": "float32", "shape": "SmolLM2-135M, 8 blocks x 128 tokens"}, "",
        by_provider(("naive: 31 HF forwards with `labels`, one layer hooked out", "naive"),
                    ('`method="bypass"` (exact)', "bypass"), ('`method="block_influence"`', "block_influence"),
                    ('`method="taylor"`', "taylor")),
        [TIME_S, TIMES_NAIVE, PEAK_MB, col("Spearman vs exact", metric="spearman_vs_exact"),
         col("max rel. diff of variant losses", metric="max_rel_diff_variant_losses")]),
    "linear_ce_train": table(
        {**CPU_SMALL, "benchmark": "linear_ce", "dtype": "float32",
         "shape": "forward+backward, N 2048 x H 576 x V 49152"},
        "head's forward+backward", by_provider(
            ("plain torch (`F.linear` + `F.cross_entropy`)", "torch"),
            ("`linear_cross_entropy(..., reduction=\"mean\")` (gradients in the forward; the training loss's path)",
             "adept_ext"),
            ("`linear_cross_entropy(...).sum()` (the backward recomputes the logits)", "adept_ext_per_row")),
        [col("ms", "ms", metric="time"), col("× torch", "x", metric="time_vs_torch"),
         col("peak extra MB", "MB", metric="peak_extra_memory"),
         col("memory × torch", "x", metric="peak_memory_vs_torch"),
         col("max rel. diff of gradients", metric="max_rel_diff_grads_vs_torch")]),
    "lr_step": table(
        LR, "AdamW step",
        by_provider(("one param group", "adamw_one_group"), ("per-unit groups, torch AdamW", "adamw_per_unit_groups"),
                    ("per-unit groups, `GroupedAdamW`", "grouped_adamw")),
        [col("ms", "ms", metric="step_time"), col("overhead %", "%", metric="step_overhead")]),
    "lr_recompute": table(
        LR, "recompute on 8 × 128 probe tokens",
        by_provider(("fused op (`UnitImportance`)", "adept_ext"), ("plain per-tensor ops", "torch_per_tensor")),
        [col("s", "s", metric="recompute_time"), col("× plain", "x", metric="recompute_speedup")]),
    "lr_multiplier": table(
        LR, "normalisation",
        by_provider(("`rank` (default)", "rank"), ("`per_kind` min–max", "per_kind"), ("`global` min–max", "global")),
        [col("mean lr multiplier", metric="mean_lr_multiplier")]),
    "projection": table(
        {**CPU_SMALL, "benchmark": "projection", "dtype": "float32"}, "k",
        [projection_k(8), projection_k(32), projection_k(64)],
        kernel_columns(("EoupCT style", "eoupct_style", "speedup_vs_eoupct_style"),
                       ("cached", "torch_cached", "speedup_vs_torch_cached"))
        + [col(f"extra MB: {label}", "MB", provider=provider, metric="peak_extra_memory")
           for label, provider in (("EoupCT", "eoupct_style"), ("cached", "torch_cached"),
                                   ("adept_ext", "adept_ext"))]),
    "projection_fixed": table(
        {**CPU_SMALL, "benchmark": "projection", "shape": "96 one-element tensors, k 8"}, "one call",
        by_provider(("cached-basis torch", "torch_cached"), ("`GradientMemory.project_`", "adept_ext")),
        [col("µs", "µs", metric="time_per_call")]),
    "lens": table(
        {"device": "cpu", "benchmark": "lens", "dtype": "float32"}, "",
        [("naive: 31 HF forwards, full logits", {"provider": "naive", **CPU_SMALL,
                                                 "shape": LENS + "4 queries, 326 tokens"}),
         ("`layer_sensitivity` (prefix-shared)", {"provider": "adept_ext", **CPU_SMALL,
                                                  "shape": LENS + "4 queries, 326 tokens"}),
         ("`--quick` (1 query, 80 tokens): naive", {"provider": "naive", **CPU_QUICK,
                                                     "shape": LENS + "1 query, 80 tokens"}),
         ("`--quick`: prefix-shared", {"provider": "adept_ext", **CPU_QUICK, "shape": LENS + "1 query, 80 tokens"})],
        [TIME_S, TIMES_NAIVE, PEAK_MB, col("max rel. diff of JS", metric="max_rel_diff_js")]),
    "placement": table(
        {**CPU_QUICK, "benchmark": "placement", "shape": "30 layers, k 4"}, "placement",
        by_provider(("`domain_aware`", "domain_aware"), ("`plasticity`", "plasticity"), ("`depth`", "depth"),
                    ("`spread`", "spread")),
        [col("cost × importance", "x", metric="time_vs_importance")]),
    "eoupct_step": table(
        {"device": "cpu", "benchmark": "eoupct_step", "dtype": "float32"}, "one step",
        [(f"{label}, batch {shape}", {"provider": provider, "size": size, "shape": f"batch {shape} tokens"})
         for size, shape in (("small --quick", "1 x 64"), ("small", "2 x 128"))
         for label, provider in (("`seq_lora`", "seq_lora"), ("`eoupct`", "eoupct"),
                                 ("`eoupct`, `--eoupct-proxy embeds`", "eoupct_embeds"))
         if (size, provider) != ("small", "eoupct_embeds")],
        [col("s", "s", metric="step_time"), col("× seq_lora", "x", metric="time_vs_seq_lora")]),
    "replay_step": table(
        {**CPU_QUICK, "benchmark": "replay_step", "dtype": "float32"}, "one step, trec-loc, 4 x 128 tokens",
        by_provider(("`seq_lora`", "seq_lora"), ("`replay`, 1 of 4 rows replayed", "replay"),
                    ("… with `--replay-distill 1`", "replay_distill"), ("… with `--ema-decay 0.9`", "replay_ema")),
        [col("s", "s", metric="step_time"), col("× seq_lora", "x", metric="time_vs_seq_lora")]),
    "probe_scaling": table(
        {**CPU_QUICK, "benchmark": "probe_scaling", "dtype": "float32",
         "shape": "SmolLM2-135M, 4 blocks x 128 tokens, batches of 2, 2 cores"}, "",
        by_provider(("1 process (2 threads)", "1_process"), ("2 gloo processes (1 thread each)", "2_processes")),
        [TIME_S, col("speed-up", "x", metric="speedup"), col("max score difference", metric="max_abs_diff_scores")]),
    "train_step": table(
        {**CPU_SMALL, "benchmark": "train_step", "dtype": "float32"}, "one step, 4 x 2048 tokens",
        [(f"`{method}`: {label}", {"provider": provider, "shape": f"{method}: smollm2-135m-shape, 4 x 2048 tokens"})
         for method in ("full", "lora", "adept")
         for label, provider in (("adept-ext (fused loss)", "adept_ext"),
                                 ("adept-ext + checkpointing", "adept_ext+checkpointing"),
                                 ("adept-ext, HF's loss", "adept_ext_hf_loss"),
                                 ("adept-ext + `--compile`", "adept_ext_compile"),
                                 ("adept-ext + `--compile` + checkpointing", "adept_ext_compile+checkpointing"),
                                 ("Trainer (default)", "trainer"), ("Trainer + checkpointing", "trainer+checkpointing"))
         if not provider.startswith(("adept_ext_hf_loss", "adept_ext_compile")) or method == "full"],
        [col("tokens/s", "tokens/s", metric="tokens_per_s"), col("× Trainer", "x", metric="tokens_per_s_vs_trainer"),
         col("peak MB", "MB", metric="peak_memory_mb"), col("memory × Trainer", "x", metric="peak_memory_vs_trainer"),
         col("first step s", "s", metric="first_step_s")]),
    "corpus": table(
        {**CPU_SMALL, "benchmark": "corpus"}, "corpus: load", corpus_rows("100 MB", 100) + corpus_rows("1 GB", 1024),
        [TIME_S, col("M tokens", "M", metric="tokens"), col("M tokens/s", "M tokens/s", metric="throughput"),
         col("peak RSS GB", "GB", metric="peak_rss"), col("workers' peak RSS GB", "GB", metric="workers_peak_rss"),
         col("killed above GB", "GB", metric="killed_above"), col("killed after s", "s", metric="time_until_killed")]),
}

MARKED = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def render_table(name, rows):
    spec = TABLES[name]
    headers = [spec["first"]] + [header for header, _, _ in spec["columns"]]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    used = []
    for label, fields in spec["rows"]:
        cells = []
        for header, unit, col_fields in spec["columns"]:
            want = {**spec["where"], **fields, **col_fields}
            match = [r for r in rows if all(r[k] == v for k, v in want.items())]
            if match and match[-1]["unit"] != unit:
                raise ValueError(f"table {name}, {label}, {header}: unit {match[-1]['unit']!r}, not {unit!r}")
            cells.append(match[-1]["value"] if match else "")
            used += match[-1:]
        if not any(cells):
            raise ValueError(f"table {name}: no row of the CSV fills {label!r}")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    runs = sorted({(r["device"], r["commit"], r["date"], r["command"], r["source"]) for r in used},
                  key=lambda run: (run[2], run[1], run[0], run[3], run[4]))  # by date, then commit: one order
    origin = "; ".join(f"{device}, {commit} ({date}), `{command}`, {source}"
                       for device, commit, date, command, source in runs)
    return "\n".join(lines) + f"\n\n<sub>Rows of docs/results/bench.csv: {origin}.</sub>\n"


def render_page(rows, page):
    """The page with every marked table rendered again from `rows`."""
    names = [m.group(2) for m in MARKED.finditer(page)]
    if sorted(names) != sorted(TABLES):
        raise ValueError(f"the page's tables {sorted(names)} are not the generator's {sorted(TABLES)}")
    return MARKED.sub(lambda m: m.group(1) + render_table(m.group(2), rows) + m.group(4), page)


def main(csv_path=CSV, page_path=PAGE, check=False):
    with open(page_path) as f:
        page = f.read()
    new = render_page(read_csv(csv_path), page)
    if check:
        if new != page:
            print(f"{page_path} is not what {csv_path} gives: run python tools/bench.py tables", file=sys.stderr)
            return 1
        print(f"{page_path} is up to date with {csv_path}")
        return 0
    with open(page_path, "w") as f:
        f.write(new)
    print(f"wrote the {len(TABLES)} tables of {page_path} from {csv_path}")
    return 0
