"""Layer probing: the exact bypass probe (prefix-shared) against the naive L+1 HF forwards, and the
cheap criteria (block_influence, taylor) with their rank agreement with the exact scores."""
import functools
import os

import torch

from adept_ext import reference
from bench.common import (
    LARGE_MODELS,
    dtype_name,
    median_time,
    peak_mb,
    plot_dir,
    random_batches,
    random_model,
    row,
    smollm2,
    touch_weights,
)


def probe_setup(n_blocks, device, batch_size=None):
    from adept_ext import data

    model, tokenizer = smollm2(device)
    blocks = data.token_blocks(data.load_texts("bbc-news")[:400], tokenizer, block_len=128)
    blocks = {k: v[:n_blocks] for k, v in blocks.items()}
    touch_weights(model, blocks["input_ids"])
    return model, data.batches(blocks, batch_size or n_blocks)


def run_probe_method(method, n_blocks, device, setup_only=False, state=None):
    """One probe run on SmolLM2 (used in-process for timing and in a child for peak memory)."""
    from adept_ext.adept.probe import layer_importance

    model, batches = state or probe_setup(n_blocks, torch.device(device))
    if setup_only:
        return model, batches
    if method == "naive":
        return reference.bypass_layer_losses(model, batches)
    return layer_importance(model, batches, method=method, progress=False)


def spearman(a, b):
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def bypass_flop_ratio(config):
    """FLOPs of the naive probe (L+1 forwards of L layers + head) over the prefix-shared one
    (L(L+1)/2 layer calls + L+1 heads), counting 2·params per token (attention scores left out)."""
    n_layers, h, v = config.num_hidden_layers, config.hidden_size, config.vocab_size
    heads = getattr(config, "head_dim", None) or h // config.num_attention_heads
    per_layer = h * heads * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) \
        + 3 * h * config.intermediate_size
    naive = (n_layers + 1) * (n_layers * per_layer + v * h)
    shared = n_layers * (n_layers + 1) // 2 * per_layer + (n_layers + 1) * v * h
    return naive / shared


def exactness(n_blocks, device, state):
    """(base loss, naive variant losses, the exact probe's result, the agreement figures)."""
    base, naive_losses = run_probe_method("naive", n_blocks, device, state=state)
    exact = run_probe_method("bypass", n_blocks, device, state=state)
    agreement = {"max_rel_diff_variant_losses": max(abs(a - b) / abs(b)
                                                    for a, b in zip(exact.variant_losses, naive_losses)),
                 "max_abs_diff_scores": max(abs(a - (b - base)) for a, b in zip(exact.scores, naive_losses))}
    return exact, agreement


def print_naive_vs_bypass(results):
    print(f"naive (L+1 HF forwards): {results['naive_s']:.2f} s, peak +{results['peak_mem_naive_mb']:.0f} MB")
    print(f"adept_ext bypass:        {results['fused_s']:.2f} s, peak +{results['peak_mem_fused_mb']:.0f} MB  "
          f"-> speedup {results['speedup_vs_naive']:.2f}x", end="")


def run_large(args, device, name):
    """Exact bypass probe vs the naive L+1 forwards on a random-weight model of a realistic shape."""
    n_batches, b, t = (1, 2, 128) if args.quick else (2, 8, 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(name, dtype, device).requires_grad_(False)
    state = (model, random_batches(model.config.vocab_size, n_batches, b, t, device))
    results = {"model": name, "dtype": dtype_name(dtype), "batches": n_batches, "batch_size": b,
               "block_len": t, "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size,
               "flop_ratio_bound": bypass_flop_ratio(model.config)}
    results.update(exactness(None, device, state)[1])
    repeats = 1 if args.quick else 3
    for key, method in (("naive", "naive"), ("fused", "bypass")):
        fn = functools.partial(run_probe_method, method, None, device, state=state)
        results[f"{key}_s"] = median_time(fn, device, repeats, 1)
        results[f"peak_mem_{key}_mb"] = peak_mb(fn, device)
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    results["memory_fraction_of_naive"] = results["peak_mem_fused_mb"] / max(results["peak_mem_naive_mb"], 1e-9)
    print(f"\nexact bypass probe, {name} ({results['layers']} layers, V {results['vocab']}, random {results['dtype']} "
          f"weights), {n_batches} batches x {b}x{t} random tokens, device {device}")
    print_naive_vs_bypass(results)
    print(f" (FLOP bound {results['flop_ratio_bound']:.2f}x), "
          f"memory {results['memory_fraction_of_naive']:.2f} of naive")
    print(f"max rel. diff of variant losses {results['max_rel_diff_variant_losses']:.2e}")
    del model, state
    return results


def run(args, device):
    if args.size == "large":
        return {name: run_large(args, device, name) for name in LARGE_MODELS}
    n_blocks = 2 if args.quick else 8
    repeats = 1 if args.quick else 2
    state = probe_setup(n_blocks, device)
    results = {"blocks": n_blocks, "block_len": 128, "layers": state[0].config.num_hidden_layers}
    exact, agreement = exactness(n_blocks, device, state)
    results.update(agreement)
    for key, method in (("naive", "naive"), ("fused", "bypass")):
        results[f"{key}_s"] = median_time(functools.partial(run_probe_method, method, n_blocks, device, state=state),
                                          device, repeats, 0)
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    for method in ("block_influence", "taylor"):
        fn = functools.partial(run_probe_method, method, n_blocks, device, state=state)
        results[f"{method}_s"] = median_time(fn, device, repeats, 0)
        results[f"{method}_spearman"] = spearman(fn().scores, exact.scores)
    for key, method in (("naive", "naive"), ("fused", "bypass")):
        results[f"peak_mem_{key}_mb"] = peak_mb(functools.partial(run_probe_method, method, n_blocks, device,
                                                                  state=state), device,
                                                fresh=functools.partial(run_probe_method, method, n_blocks, "cpu"))
    results["scores"] = exact.scores
    results["least_important"] = exact.select(4)
    results["plot"] = os.path.join(plot_dir(args), "layer_importance.png")
    exact.plot(results["plot"], title=f"SmolLM2-135M layer importance (bypass Δloss, {exact.tokens} BBC News tokens)",
               highlight=results["least_important"])
    print(f"\nlayer probing on SmolLM2-135M ({results['layers']} layers), {n_blocks} blocks x 128 BBC News tokens, "
          f"device {device}")
    print_naive_vs_bypass(results)
    print()
    print(f"max rel. diff of variant losses {results['max_rel_diff_variant_losses']:.2e}, "
          f"max abs diff of scores {results['max_abs_diff_scores']:.2e}")
    for method in ("block_influence", "taylor"):
        print(f"{method:16} {results[method + '_s']:.2f} s, Spearman vs exact {results[method + '_spearman']:.3f}")
    print(f"4 least important layers: {results['least_important']}")
    return results


def rows(results):
    if "blocks" not in results:  # --size large: one result per model shape
        return [r for res in results.values() for r in large_rows(res)]
    fields = {"dtype": "float32", "shape": f"SmolLM2-135M, {results['blocks']} blocks x {results['block_len']} tokens"}
    out = [row("naive", "time", results["naive_s"], "s", **fields),
           row("bypass", "time", results["fused_s"], "s", **fields),
           row("bypass", "speedup_vs_naive", results["speedup_vs_naive"], "x", **fields),
           row("naive", "peak_extra_memory", results["peak_mem_naive_mb"], "MB", **fields),
           row("bypass", "peak_extra_memory", results["peak_mem_fused_mb"], "MB", **fields),
           row("bypass", "max_rel_diff_variant_losses", results["max_rel_diff_variant_losses"], "", **fields)]
    for method in ("block_influence", "taylor"):
        out += [row(method, "time", results[f"{method}_s"], "s", **fields),
                row(method, "spearman_vs_exact", results[f"{method}_spearman"], "", **fields)]
    return out


def large_rows(r):
    fields = {"dtype": r["dtype"],
              "shape": f"{r['model']}, {r['batches']} batches x {r['batch_size']}x{r['block_len']}"}
    return [row("naive", "time", r["naive_s"], "s", **fields),
            row("bypass", "time", r["fused_s"], "s", **fields),
            row("bypass", "speedup_vs_naive", r["speedup_vs_naive"], "x", **fields),
            row("bypass", "flop_ratio_bound", r["flop_ratio_bound"], "x", **fields),
            row("naive", "peak_extra_memory", r["peak_mem_naive_mb"], "MB", **fields),
            row("bypass", "peak_extra_memory", r["peak_mem_fused_mb"], "MB", **fields),
            row("bypass", "memory_fraction_of_naive", r["memory_fraction_of_naive"], "", **fields),
            row("bypass", "max_rel_diff_variant_losses", r["max_rel_diff_variant_losses"], "", **fields)]
