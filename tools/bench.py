#!/usr/bin/env python
"""Benchmarks of adept_ext kernels against the plain-PyTorch ways a user would write them,
measured in one run on the same data. Medians over repeats, after warm-up.

    python tools/bench.py importance|probe|lr|projection|lens|all [--quick] [--json PATH] [--device cpu|cuda]
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

import adept_ext
from adept_ext import reference

# Nominal memory bandwidth (GB/s) of cards a GPU check may run on, to report a second fraction.
NOMINAL_GBPS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_info(device):
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "device": str(device), "cuda_kernels_compiled": adept_ext.cuda_available()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def nominal_gbps(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in NOMINAL_GBPS.items() if k in name), None)


# ---------------------------------------------------------------- importance
def qwen3_layer_shapes(n_layers):
    """Parameter shapes of Qwen3-0.6B-sized decoder layers: hidden 1024, intermediate 3072,
    16 q heads / 8 kv heads of dim 128, q/k norms (about 15.7M elements per layer)."""
    h, inter, hd, nq, nkv = 1024, 3072, 128, 16, 8
    layer = [(nq * hd, h), (nkv * hd, h), (nkv * hd, h), (h, nq * hd), (hd,), (hd,),
             (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * n_layers


def naive_importance(params, grads):
    return torch.stack([torch.stack([(p * g).sum(), (p * g).abs().sum()]) for p, g in zip(params, grads)])


def foreach_importance(params, grads):
    prods = torch._foreach_mul(params, grads)
    return torch.stack([torch.stack([x.sum() for x in prods]), torch.stack(torch._foreach_norm(prods, 1))], 1)


def bench_importance(args, device):
    shapes = qwen3_layer_shapes(1 if args.quick else 4)
    repeats = (3 if args.quick else 10) * (5 if device.type == "cuda" else 1)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        numel = sum(p.numel() for p in params)
        nbytes = 2 * numel * params[0].element_size()
        # The implementations must agree before they are timed.
        exact = reference.taylor_importance(params, grads)
        fused = adept_ext.taylor_importance(params, grads)
        torch.testing.assert_close(fused.double().cpu(), exact, rtol=1e-4, atol=1e-3)
        flat = torch.randn(nbytes // 4, device=device, dtype=torch.float32)

        t_naive = median_time(lambda: naive_importance(params, grads), device, repeats)
        t_foreach = median_time(lambda: foreach_importance(params, grads), device, repeats)
        t_fused = median_time(lambda: adept_ext.taylor_importance(params, grads), device, repeats)
        t_probe = median_time(lambda: torch.sum(flat), device, repeats)
        row = {
            "tensors": len(params), "elements": numel, "bytes": nbytes,
            "naive_s": t_naive, "foreach_s": t_foreach, "fused_s": t_fused, "bandwidth_probe_s": t_probe,
            "speedup_vs_naive": t_naive / t_fused, "speedup_vs_foreach": t_foreach / t_fused,
            "fused_gbps": nbytes / t_fused / 1e9, "bandwidth_probe_gbps": nbytes / t_probe / 1e9,
        }
        row["bandwidth_fraction"] = row["fused_gbps"] / row["bandwidth_probe_gbps"]
        if nominal_gbps(device):
            row["nominal_gbps"] = nominal_gbps(device)
            row["nominal_bandwidth_fraction"] = row["fused_gbps"] / row["nominal_gbps"]
        results[str(dtype).replace("torch.", "")] = row
        del params, grads, flat

    print(f"\ntaylor_importance on {len(shapes)} tensors ({results['float32']['elements'] / 1e6:.1f}M elements), "
          f"device {device}, {torch.get_num_threads()} threads; bandwidth probe = torch.sum over a float32 buffer of equal bytes")
    print(f"{'dtype':9} {'naive ms':>9} {'foreach ms':>10} {'fused ms':>9} {'x naive':>8} {'x foreach':>9} "
          f"{'fused GB/s':>10} {'probe GB/s':>10} {'bw frac':>8}")
    for name, r in results.items():
        print(f"{name:9} {r['naive_s'] * 1e3:9.2f} {r['foreach_s'] * 1e3:10.2f} {r['fused_s'] * 1e3:9.2f} "
              f"{r['speedup_vs_naive']:8.2f} {r['speedup_vs_foreach']:9.2f} {r['fused_gbps']:10.1f} "
              f"{r['bandwidth_probe_gbps']:10.1f} {r['bandwidth_fraction']:8.2f}")
    return results


# ---------------------------------------------------------------- probe
def peak_rss_mb(fn, *args):
    """Run fn(*args) in a fresh process; its peak resident memory above the level before the call, in MB."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_rss_child, args=(queue, fn, args))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, str):
        raise RuntimeError(result)
    return result


def _read_status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_rss_child(queue, fn, args):
    try:
        setup = fn(*args, setup_only=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        base = _read_status_kb("VmRSS")
        fn(*args, state=setup)
        queue.put((_read_status_kb("VmHWM") - base) / 1024)
    except Exception as e:  # reported to the parent, which raises
        queue.put(f"{type(e).__name__}: {e}")


def peak_cuda_mb(fn, device):
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def peak_memory_mb(run, method, size, device, state):
    """Peak extra memory of run(method, size, device): CUDA allocator peak, or a child process's RSS on a CPU."""
    if device.type == "cuda":
        return peak_cuda_mb(lambda: run(method, size, device, state=state), device)
    return peak_rss_mb(run, method, size, "cpu")


def probe_setup(n_blocks, device):
    from adept_ext import data
    from adept_ext.models import load_model

    model, tokenizer = load_model("smollm2-135m", device=device)
    blocks = data.token_blocks(data.load_texts("bbc-news")[:400], tokenizer, block_len=128)
    blocks = {k: v[:n_blocks] for k, v in blocks.items()}
    with torch.no_grad():  # touch the (memory-mapped) weights so that they count as the baseline
        model(input_ids=blocks["input_ids"][:1, :8])
    return model, data.batches(blocks, n_blocks)


def run_probe_method(method, n_blocks, device, setup_only=False, state=None):
    """One probe run on SmolLM2 (used in-process for timing and in a child for peak memory)."""
    from adept_ext.probe import layer_importance

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


def bench_probe(args, device):
    n_blocks = 2 if args.quick else 8
    repeats = 1 if args.quick else 2
    state = probe_setup(n_blocks, device)
    results = {"blocks": n_blocks, "block_len": 128, "layers": state[0].config.num_hidden_layers}
    base, naive_losses = run_probe_method("naive", n_blocks, device, state=state)
    exact = run_probe_method("bypass", n_blocks, device, state=state)
    naive_scores = [v - base for v in naive_losses]
    results["max_rel_diff_variant_losses"] = max(abs(a - b) / abs(b) for a, b in zip(exact.variant_losses, naive_losses))
    results["max_abs_diff_scores"] = max(abs(a - b) for a, b in zip(exact.scores, naive_scores))
    results["naive_s"] = median_time(lambda: run_probe_method("naive", n_blocks, device, state=state), device, repeats, 0)
    results["fused_s"] = median_time(lambda: run_probe_method("bypass", n_blocks, device, state=state), device, repeats, 0)
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    for method in ("block_influence", "taylor"):
        t = median_time(lambda: run_probe_method(method, n_blocks, device, state=state), device, repeats, 0)
        cheap = run_probe_method(method, n_blocks, device, state=state)
        results[f"{method}_s"] = t
        results[f"{method}_spearman"] = spearman(cheap.scores, exact.scores)
    for name, method in (("naive", "naive"), ("fused", "bypass")):
        results[f"peak_mem_{name}_mb"] = peak_memory_mb(run_probe_method, method, n_blocks, device, state)
    results["scores"] = exact.scores
    results["least_important"] = exact.select(4)
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else "bench-results"
    os.makedirs(out_dir, exist_ok=True)
    results["plot"] = os.path.join(out_dir, "layer_importance.png")
    exact.plot(results["plot"], title=f"SmolLM2-135M layer importance (bypass Δloss, {exact.tokens} BBC News tokens)",
               highlight=results["least_important"])
    print(f"\nlayer probing on SmolLM2-135M ({results['layers']} layers), {n_blocks} blocks x 128 BBC News tokens, device {device}")
    print(f"naive (L+1 HF forwards): {results['naive_s']:.2f} s, peak +{results['peak_mem_naive_mb']:.0f} MB")
    print(f"adept_ext bypass:        {results['fused_s']:.2f} s, peak +{results['peak_mem_fused_mb']:.0f} MB  "
          f"-> speedup {results['speedup_vs_naive']:.2f}x")
    print(f"max rel. diff of variant losses {results['max_rel_diff_variant_losses']:.2e}, "
          f"max abs diff of scores {results['max_abs_diff_scores']:.2e}")
    for method in ("block_influence", "taylor"):
        print(f"{method:16} {results[method + '_s']:.2f} s, Spearman vs exact {results[method + '_spearman']:.3f}")
    print(f"4 least important layers: {results['least_important']}")
    return results


# ---------------------------------------------------------------- lens
def lens_setup(n_queries, device):
    from adept_ext import data
    from adept_ext.models import load_model

    model, tokenizer = load_model("smollm2-135m", device=device)
    batches = [{k: v.to(device) for k, v in b.items()}
               for b in data.fewshot_topic_task(tokenizer, n_queries=n_queries, shots=2, words=16, batch_size=n_queries)]
    with torch.no_grad():  # touch the (memory-mapped) weights so that they count as the baseline
        model(input_ids=batches[0]["input_ids"][:1, :8])
    return model, batches


def run_lens_method(method, n_queries, device, setup_only=False, state=None):
    """Layer sensitivity on SmolLM2 few-shot BBC topics: naive (one perturbed full forward per
    layer, HF logits) or fused (prefix-shared variants); in-process for timing, in a child for memory."""
    from adept_ext.lens import layer_sensitivity

    model, batches = state or lens_setup(n_queries, torch.device(device))
    if setup_only:
        return model, batches
    if method == "naive":
        return reference.context_masked_js(model, batches[0], batches[0]["context_mask"], batches[0]["score_mask"]).mean(1).tolist()
    return layer_sensitivity(model, batches, progress=False).js


def bench_lens(args, device):
    n_queries = 1 if args.quick else 4
    state = lens_setup(n_queries, device)
    b = state[1][0]
    results = {"queries": n_queries, "tokens": int(b["attention_mask"].sum()), "layers": state[0].config.num_hidden_layers,
               "task": "few-shot BBC News topics, 2 shots x 16 words"}
    timed = {}
    for method in ("naive", "fused"):  # one timed run each, in this process (a naive run takes minutes on a CPU)
        sync(device)
        t0 = time.perf_counter()
        timed[method] = run_lens_method(method, n_queries, device, state=state)
        sync(device)
        results[f"{method}_s"] = time.perf_counter() - t0
    naive, fused = timed["naive"], timed["fused"]
    results["max_rel_diff_js"] = max(abs(a - w) / w for a, w in zip(fused, naive))
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    for method in ("naive", "fused"):
        results[f"peak_mem_{method}_mb"] = peak_memory_mb(run_lens_method, method, n_queries, device, state)
    results["js"] = fused
    print(f"\nlayer sensitivity on SmolLM2-135M ({results['layers']} layers), {n_queries} few-shot BBC queries "
          f"({results['tokens']} tokens), device {device}")
    print(f"naive (one perturbed HF forward per layer): {results['naive_s']:.2f} s, peak +{results['peak_mem_naive_mb']:.0f} MB")
    print(f"adept_ext prefix-shared:                    {results['fused_s']:.2f} s, peak +{results['peak_mem_fused_mb']:.0f} MB"
          f"  -> speedup {results['speedup_vs_naive']:.2f}x")
    print(f"max rel. diff of JS per layer {results['max_rel_diff_js']:.2e}")
    return results


# ---------------------------------------------------------------- lr
def plain_recompute(model, units, batches):
    """The recompute written with plain per-tensor PyTorch ops (what a user would write)."""
    params = dict(model.named_parameters())
    tensors = [params[u.name] for u in units]
    totals = [0.0] * len(tensors)
    for batch in batches:
        grads = torch.autograd.grad(model(**batch, use_cache=False).loss, tensors)
        for i, (p, g) in enumerate(zip(tensors, grads)):
            totals[i] += (p.detach() * g).abs().mean().item()
    return [t / len(batches) for t in totals]


def bench_lr(args, device):
    import copy

    from adept_ext import data
    from adept_ext.expand import expand_layers
    from adept_ext.lr import DecoupledLR, param_groups
    from adept_ext.models import load_model
    from adept_ext.probe import layer_importance
    from adept_ext.report import plot_unit_rates
    from adept_ext.units import UnitImportance

    steps = 4 if args.quick else 12
    model, tokenizer = load_model("smollm2-135m", device=device)
    general = data.token_blocks(data.load_texts("bbc-news")[:300], tokenizer, block_len=128)
    domain = data.token_blocks(data.load_texts("python-docs"), tokenizer, block_len=128)
    chosen = layer_importance(model, data.batches(general, 2, limit=1), progress=False).select(4)
    expand_layers(model, chosen)
    train_batches = data.batches(domain, 4, limit=steps + 2)
    probe = data.batches({k: v[-8:] for k, v in domain.items()}, 2)  # 8 x 128 probe tokens, not trained on

    plain_model = copy.deepcopy(model).train()
    plain_opt = torch.optim.AdamW([p for p in plain_model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    ours_model = copy.deepcopy(model).train()
    ours_opt = torch.optim.AdamW(param_groups(ours_model, 1e-4, weight_decay=0.01))
    importance = UnitImportance(ours_model, probe)
    decoupled = DecoupledLR(ours_opt, importance, every=10**9)  # no recompute inside the timed steps

    def step(m, opt, batch):
        opt.zero_grad(set_to_none=True)
        m(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss.backward()
        opt.step()

    times = {"plain": [], "decoupled": []}
    for i, batch in enumerate(train_batches):  # interleaved, so that machine noise hits both alike
        for name, m, opt in (("plain", plain_model, plain_opt), ("decoupled", ours_model, ours_opt)):
            sync(device)
            start = time.perf_counter()
            step(m, opt, batch)
            sync(device)
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    plain_s, ours_s = statistics.median(times["plain"]), statistics.median(times["decoupled"])

    fused_recompute = median_time(lambda: importance.raw_scores(), device, 3 if not args.quick else 1, 1)
    plain_recompute_s = median_time(lambda: plain_recompute(ours_model, importance.units, probe), device,
                                    3 if not args.quick else 1, 1)
    torch.testing.assert_close(torch.tensor(importance.raw_scores()),
                               torch.tensor(plain_recompute(ours_model, importance.units, probe), dtype=torch.float32),
                               rtol=1e-3, atol=1e-12)
    decoupled.recompute()
    mult = decoupled.multipliers
    results = {
        "expanded_layers": ours_model.config.adept["expanded_layers"], "units": len(mult),
        "plain_step_s": plain_s, "decoupled_step_s": ours_s, "step_overhead": ours_s / plain_s - 1,
        "recompute_fused_s": fused_recompute, "recompute_plain_s": plain_recompute_s,
        "recompute_speedup": plain_recompute_s / fused_recompute,
        "mean_multiplier_after_recompute": decoupled.mean_multiplier,
        "rates": {u.name: m for u, m in zip(importance.units, mult)},
    }
    for normalize in ("per_kind", "global", "rank"):
        imp = UnitImportance(ours_model, probe, normalize=normalize)
        results[f"mean_multiplier_{normalize}"] = sum(max(2 * (1 - s), decoupled.floor) for s in imp.compute()) / len(mult)
    results["mean_multiplier_source_scores"] = sum(max(2 * (1 - s), decoupled.floor)
                                                   for s in importance.compute(use_source=True)) / len(mult)
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else "bench-results"
    os.makedirs(out_dir, exist_ok=True)
    results["heatmap"] = os.path.join(out_dir, "unit_rates.png")
    plot_unit_rates(importance.units, mult, results["heatmap"],
                    title=f"ADEPT per-unit lr multipliers, SmolLM2-135M, copies of {chosen}")

    print(f"\nDecoupledLR on SmolLM2-135M expanded at {chosen} ({len(mult)} units), AdamW, batch 4x128, device {device}")
    print(f"step: plain {plain_s * 1e3:.0f} ms, with DecoupledLR {ours_s * 1e3:.0f} ms -> overhead {results['step_overhead'] * 100:+.1f}%")
    print(f"recompute on 8x128 probe tokens: fused {fused_recompute:.2f} s, plain per-tensor {plain_recompute_s:.2f} s "
          f"-> speedup {results['recompute_speedup']:.2f}x")
    print("mean lr multiplier: " + ", ".join(f"{k[len('mean_multiplier_'):]} {v:.3f}" for k, v in results.items()
                                             if k.startswith("mean_multiplier_")))
    print(f"{'unit':48} {'multiplier':>10}")
    for u, m in zip(importance.units, mult):
        print(f"{u.name:48} {m:10.3f}")
    print(f"heatmap: {results['heatmap']}")
    return results


# ---------------------------------------------------------------- projection
def projection_shapes():
    """8 decoder layers (hidden 448, intermediate 1200, q/k/v biases, 2 norms): 96 tensors, 19.3M elements."""
    h, inter = 448, 1200
    layer = [(h, h), (h, h), (h, h), (h, h), (h,), (h,), (h,), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * 8


def rss_peak_mb(fn):
    """Peak resident memory of fn() above the level before it, in this process (MB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _read_status_kb("VmRSS")
    fn()
    return (_read_status_kb("VmHWM") - base) / 1024


def bench_projection(args, device):
    import math

    from adept_ext.projection import GradientMemory

    shapes = projection_shapes()
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    ks = (8, 32) if args.quick else (8, 32, 64)
    repeats = 2 if args.quick else 3
    grads = [torch.randn(s, device=device) for s in shapes]
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    results = {"tensors": len(shapes), "elements": n, "by_k": {}}

    def eoupct_style(memory_rows, k):
        m = torch.stack(memory_rows, dim=1)  # re-stacked every step
        inv = torch.inverse(m.T @ m + 1e-4 * torch.eye(k, device=device))
        g = torch.cat([t.reshape(-1) for t in grads])
        g = g - m @ (inv @ (m.T @ g))
        for t, part in zip(grads, g.split(sizes)):
            t.copy_(part.view_as(t))

    def torch_cached(q):
        g = torch.cat([t.reshape(-1) for t in grads])
        g -= q.T @ (q @ g)
        for t, part in zip(grads, g.split(sizes)):
            t.copy_(part.view_as(t))

    for k in ks:
        q_flat, _ = torch.linalg.qr(torch.randn(n, k, device=device))
        q = q_flat.T.contiguous()  # [k, n], cached orthonormal basis
        del q_flat
        rows = list(q.unbind(0))
        nbytes = 2 * n * k * 4 + 3 * n * 4
        probe = torch.randn(min(nbytes, 2 << 30) // 4, device=device)
        t_probe = median_time(lambda: torch.sum(probe), device, repeats) * nbytes / (probe.numel() * 4)
        del probe
        t_eoupct = median_time(lambda: eoupct_style(rows, k), device, repeats, 1)
        t_cached = median_time(lambda: torch_cached(q), device, repeats, 1)
        mem_eoupct = peak_cuda_mb(lambda: eoupct_style(rows, k), device) if device.type == "cuda" else rss_peak_mb(lambda: eoupct_style(rows, k))
        mem_cached = peak_cuda_mb(lambda: torch_cached(q), device) if device.type == "cuda" else rss_peak_mb(lambda: torch_cached(q))
        memory = GradientMemory(params, max_directions=k)
        for s, part in zip(memory.storage, q.split(sizes, dim=1)):
            s.copy_(part.reshape(s.shape))
        memory.k = k
        check = [g.clone() for g in grads]
        torch_cached(q)
        memory.project_(check)
        torch.testing.assert_close(torch.cat([c.reshape(-1) for c in check]), torch.cat([g.reshape(-1) for g in grads]),
                                   rtol=1e-4, atol=1e-4)
        del q, rows, check
        t_ours = median_time(lambda: memory.project_(grads), device, repeats, 1)
        mem_ours = peak_cuda_mb(lambda: memory.project_(grads), device) if device.type == "cuda" else rss_peak_mb(lambda: memory.project_(grads))
        del memory
        row = {"eoupct_style_s": t_eoupct, "torch_cached_s": t_cached, "fused_s": t_ours, "bandwidth_probe_s": t_probe,
               "speedup_vs_eoupct_style": t_eoupct / t_ours, "speedup_vs_torch_cached": t_cached / t_ours,
               "fused_gbps": nbytes / t_ours / 1e9, "bandwidth_probe_gbps": nbytes / t_probe / 1e9,
               "extra_peak_mb_eoupct_style": mem_eoupct, "extra_peak_mb_torch_cached": mem_cached,
               "extra_peak_mb_fused": mem_ours, "grads_mb": n * 4 / 2**20}
        row["bandwidth_fraction"] = row["fused_gbps"] / row["bandwidth_probe_gbps"]
        results["by_k"][str(k)] = row

    print(f"\nnull-space projection of {n / 1e6:.1f}M float32 gradients in {len(shapes)} tensors, device {device}; "
          "bandwidth bytes = 2nk*4 + 3n*4")
    print(f"{'k':>3} {'eoupct ms':>10} {'cached ms':>10} {'fused ms':>9} {'x eoupct':>9} {'x cached':>9} "
          f"{'GB/s':>6} {'bw frac':>8} {'+MB eoupct':>10} {'+MB cached':>10} {'+MB fused':>9}")
    for k, r in results["by_k"].items():
        print(f"{k:>3} {r['eoupct_style_s'] * 1e3:10.1f} {r['torch_cached_s'] * 1e3:10.1f} {r['fused_s'] * 1e3:9.1f} "
              f"{r['speedup_vs_eoupct_style']:9.2f} {r['speedup_vs_torch_cached']:9.2f} {r['fused_gbps']:6.1f} "
              f"{r['bandwidth_fraction']:8.2f} {r['extra_peak_mb_eoupct_style']:10.0f} "
              f"{r['extra_peak_mb_torch_cached']:10.0f} {r['extra_peak_mb_fused']:9.1f}")
    return results


BENCHMARKS = {"importance": bench_importance, "probe": bench_probe, "lr": bench_lr, "projection": bench_projection,
              "lens": bench_lens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and adept_ext.cuda_available()):
        sys.exit("--device cuda: no GPU, or adept_ext was built without CUDA kernels")
    names = list(BENCHMARKS) if args.benchmark == "all" else [args.benchmark]
    results = {"machine": machine_info(device)}
    for name in names:
        results[name] = BENCHMARKS[name](args, device)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
