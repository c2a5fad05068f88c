#!/usr/bin/env python
"""Benchmarks of adept_ext kernels against the plain-PyTorch ways a user would write them (and,
for linear_cross_entropy, the installed peers: cut-cross-entropy, Liger), measured in one run on
the same data. Medians over repeats, after warm-up.

    python tools/bench.py importance|probe|lr|projection|lens|linear_ce|placement|probe_scaling|eoupct_step|corpus|all
        [--size small|large] [--quick] [--json PATH] [--device cpu|cuda]

--size small (default) is what 2 CPU cores finish in minutes; --size large is what users run on
a GPU: 1B-scale tensor lists, random-weight Qwen3-0.6B- and Llama-3.2-1B-shaped models built from
configs (no downloads), N 8192 x H 2048 x V 128256 for linear_cross_entropy.
"""
import argparse
import functools
import json
import math
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


def machine_info(device, size):
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "device": str(device), "size": size, "cuda_kernels_compiled": adept_ext.cuda_available(),
            "cuda_arch_list": adept_ext.compiled_cuda_arch_list()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
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


def llama1b_layer_shapes(n_layers):
    """Parameter shapes of Llama-3.2-1B-sized decoder layers: hidden 2048, intermediate 8192,
    32 q / 8 kv heads of dim 64, 2 norms (9 tensors, 60.8M elements per layer): 16 layers are
    144 tensors and 973M elements (the 1B scale), 8 layers 72 tensors and 487M."""
    h, inter, kv = 2048, 8192, 512
    layer = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * n_layers


def naive_importance(params, grads):
    return torch.stack([torch.stack([(p * g).sum(), (p * g).abs().sum()]) for p, g in zip(params, grads)])


def foreach_importance(params, grads):
    prods = torch._foreach_mul(params, grads)
    return torch.stack([torch.stack([x.sum() for x in prods]), torch.stack(torch._foreach_norm(prods, 1))], 1)


def bench_importance(args, device):
    if args.size == "large":
        shapes = llama1b_layer_shapes(2 if args.quick else 16)
    else:
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
        torch.testing.assert_close(fused.double().cpu(), exact.cpu(), rtol=1e-4, atol=1e-3)
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


# Random-weight models of realistic shapes, built from configs (no downloads): --size large.
LARGE_MODELS = {
    "qwen3-0.6b-shape": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       vocab_size=151936, tie_word_embeddings=True)),
    "llama-3.2-1b-shape": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                         vocab_size=128256, tie_word_embeddings=True)),
}


def random_model(name, dtype, device, **overrides):
    """A randomly initialised HF causal LM of LARGE_MODELS[name]'s shape (overrides: config fields)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = LARGE_MODELS[name]
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def random_batches(vocab, n_batches, batch, seq, device, seed=1):
    """Batches of uniformly random tokens (labels = input_ids), as the bench's stand-in corpus."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "labels": ids.to(device)})
    return out


def peak_mb(fn, device):
    """Peak extra memory of fn() in this process (MB): the CUDA allocator's, or the resident set on a CPU."""
    return peak_cuda_mb(fn, device) if device.type == "cuda" else rss_peak_mb(fn)


def probe_setup(n_blocks, device, batch_size=None):
    from adept_ext import data
    from adept_ext.models import load_model

    model, tokenizer = load_model("smollm2-135m", device=device)
    blocks = data.token_blocks(data.load_texts("bbc-news")[:400], tokenizer, block_len=128)
    blocks = {k: v[:n_blocks] for k, v in blocks.items()}
    with torch.no_grad():  # touch the (memory-mapped) weights so that they count as the baseline
        model(input_ids=blocks["input_ids"][:1, :8])
    return model, data.batches(blocks, batch_size or n_blocks)


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


def bench_probe_large(args, device, name):
    """Exact bypass probe vs the naive L+1 forwards on a random-weight model of a realistic shape."""
    n_batches, b, t = (1, 2, 128) if args.quick else (2, 8, 512)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(name, dtype, device).requires_grad_(False)
    state = (model, random_batches(model.config.vocab_size, n_batches, b, t, device))
    results = {"model": name, "dtype": str(dtype).replace("torch.", ""), "batches": n_batches, "batch_size": b,
               "block_len": t, "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size,
               "flop_ratio_bound": bypass_flop_ratio(model.config)}
    base, naive_losses = run_probe_method("naive", None, device, state=state)
    exact = run_probe_method("bypass", None, device, state=state)
    results["max_rel_diff_variant_losses"] = max(abs(a - b) / abs(b)
                                                 for a, b in zip(exact.variant_losses, naive_losses))
    results["max_abs_diff_scores"] = max(abs(a - (b - base)) for a, b in zip(exact.scores, naive_losses))
    repeats = 1 if args.quick else 3
    for key, method in (("naive", "naive"), ("fused", "bypass")):
        run = functools.partial(run_probe_method, method, None, device, state=state)
        results[f"{key}_s"] = median_time(run, device, repeats, 1)
        results[f"peak_mem_{key}_mb"] = peak_mb(run, device)
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    results["memory_fraction_of_naive"] = results["peak_mem_fused_mb"] / max(results["peak_mem_naive_mb"], 1e-9)
    print(f"\nexact bypass probe, {name} ({results['layers']} layers, V {results['vocab']}, random {results['dtype']} "
          f"weights), {n_batches} batches x {b}x{t} random tokens, device {device}")
    print(f"naive (L+1 HF forwards): {results['naive_s']:.2f} s, peak +{results['peak_mem_naive_mb']:.0f} MB")
    print(f"adept_ext bypass:        {results['fused_s']:.2f} s, peak +{results['peak_mem_fused_mb']:.0f} MB  "
          f"-> speedup {results['speedup_vs_naive']:.2f}x (FLOP bound {results['flop_ratio_bound']:.2f}x), "
          f"memory {results['memory_fraction_of_naive']:.2f} of naive")
    print(f"max rel. diff of variant losses {results['max_rel_diff_variant_losses']:.2e}")
    del model, state
    return results


def bench_probe(args, device):
    if args.size == "large":
        return {name: bench_probe_large(args, device, name) for name in LARGE_MODELS}
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


# ---------------------------------------------------------------- placement
def bench_placement(args, device):
    """Cost of each Stage 1 placement criterion relative to ADEPT's importance probe (the same
    general probe; domain_aware adds a bypass probe of the domain, plasticity one backward pass)."""
    from adept_ext import data, placement
    from adept_ext.models import load_model

    if args.size == "large":
        model = random_model("qwen3-0.6b-shape", torch.bfloat16, device)
        general = random_batches(model.config.vocab_size, 2, 8, 512, device)
        domain = random_batches(model.config.vocab_size, 2, 8, 512, device, seed=2)
    else:
        model, tokenizer = load_model("smollm2-135m", device=device)
        n_blocks = 2 if args.quick else 8

        def probe(corpus):
            blocks = data.token_blocks(data.load_texts(corpus)[:200], tokenizer, block_len=128)
            return data.batches({k: v[:n_blocks] for k, v in blocks.items()}, 4)

        general, domain = probe("bbc-news"), probe("python-docs")
    repeats = 1 if args.quick or args.size == "large" else 2
    results = {"layers": model.config.num_hidden_layers, "k": 4}
    for name in placement.PLACEMENTS:
        run = functools.partial(placement.choose, name, model, 4, general, domain, progress=False)
        results[f"{name}_s"] = median_time(run, device, repeats, 0)
        results[f"{name}_layers"] = run()["layers"]
    base = results["importance_s"]
    print(f"\nplacement criteria on {model.config.num_hidden_layers} layers, k = 4, device {device}")
    for name in placement.PLACEMENTS:
        results[f"{name}_vs_importance"] = results[f"{name}_s"] / base
        print(f"{name:13} {results[name + '_s']:7.2f} s  {results[name + '_vs_importance']:5.2f}x importance  "
              f"layers {results[name + '_layers']}")
    return results


# ---------------------------------------------------------------- eoupct_step
def bench_eoupct_step(args, device):
    """One optimizer step (loss, backward, clipping, AdamW) of seq_lora against eoupct on the same
    model and batch, in the same run: eoupct adds the proxy gradient (every step), the prompt search
    with the virtual step (every eoupct_proxy_every steps, averaged over such a cycle), and the
    projections. Shown: the ratio eoupct / seq_lora (the target is <= 3 on a CPU)."""
    from adept_ext.continual import ContinualConfig
    from adept_ext.methods import Context, create
    from adept_ext.models import load_model
    from adept_ext.train import optimizer_for

    if args.size == "large":
        make = functools.partial(random_model, "qwen3-0.6b-shape", torch.float32, device)
        batch_size, seq = 8, 512
    else:
        make = lambda: load_model("smollm2-135m", device=device)[0]  # noqa: E731
        batch_size, seq = (1, 64) if args.quick else (2, 128)
    cycles = 1 if args.quick else 2
    results = {"batch": batch_size, "seq": seq}
    for name, extra in (("seq_lora", {}), ("eoupct", {}), ("eoupct_embeds", {"eoupct_proxy": "embeds"})):
        cfg = ContinualConfig(method=name.split("_embeds")[0], lora_rank=4, steps=100, warmup_steps=0, **extra)
        model = make()
        batch = random_batches(model.config.vocab_size, 1, batch_size, seq, device)[0]
        method = create(cfg.method, cfg, sequence=True)
        setup = method.prepare(model, Context(general_probe=[]))
        optimizer, _ = optimizer_for(method, setup, cfg)
        model.train()

        def cycle():  # eoupct_proxy_every steps: one with the prompt search, the others without
            for _ in range(cfg.eoupct_proxy_every):
                optimizer.zero_grad(set_to_none=True)
                method.loss(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(setup.trainable, 1.0)
                optimizer.step()

        results[f"{name}_step_s"] = median_time(cycle, device, cycles, warmup=1) / cfg.eoupct_proxy_every
        del model, method, optimizer
    base = results["seq_lora_step_s"]
    print(f"\none optimizer step, batch {batch_size} x {seq} tokens, device {device} "
          f"({torch.get_num_threads()} threads)")
    for name in ("seq_lora", "eoupct", "eoupct_embeds"):
        results[f"{name}_vs_seq_lora"] = results[f"{name}_step_s"] / base
        print(f"{name:14} {results[name + '_step_s'] * 1e3:9.1f} ms  {results[name + '_vs_seq_lora']:5.2f}x seq_lora")
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
def plain_recompute(model, units, batches, autocast_dtype=None):
    """The recompute written with plain per-tensor PyTorch ops (what a user would write)."""
    params = dict(model.named_parameters())
    tensors = [params[u.name] for u in units]
    totals = [0.0] * len(tensors)
    device = tensors[0].device
    for batch in batches:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch, use_cache=False).loss
        grads = torch.autograd.grad(loss, tensors)
        for i, (p, g) in enumerate(zip(tensors, grads)):
            totals[i] += (p.detach() * g).abs().mean().item()
    return [t / len(batches) for t in totals]


def lr_setup(args, device):
    """(model expanded with 4 copies, the copied layers, train batches, probe batches, description)."""
    from adept_ext import data
    from adept_ext.expand import expand_layers
    from adept_ext.models import load_model
    from adept_ext.probe import layer_importance

    steps = 4 if args.quick else 12
    if args.size == "large":
        model = random_model("qwen3-0.6b-shape", torch.float32, device)
        n, vocab = model.config.num_hidden_layers, model.config.vocab_size
        chosen = [n // 4 - 1, n // 2 - 1, 3 * n // 4 - 1, n - 1]  # random weights: spread, not probed
        b, t = (2, 128) if args.quick else (8, 1024)
        train_batches = random_batches(vocab, steps + 2, b, t, device, seed=1)
        probe = random_batches(vocab, 2, b, t, device, seed=2)
        description = f"Qwen3-0.6B shape (random fp32 weights), batch {b}x{t}"
    else:
        model, tokenizer = load_model("smollm2-135m", device=device)
        general = data.token_blocks(data.load_texts("bbc-news")[:300], tokenizer, block_len=128)
        domain = data.token_blocks(data.load_texts("python-docs"), tokenizer, block_len=128)
        chosen = layer_importance(model, data.batches(general, 2, limit=1), progress=False).select(4)
        train_batches = data.batches(domain, 4, limit=steps + 2)
        probe = data.batches({k: v[-8:] for k, v in domain.items()}, 2)  # 8 x 128 probe tokens, not trained on
        description = "SmolLM2-135M, batch 4x128 Python-docs tokens"
    expand_layers(model, chosen)
    return model, chosen, train_batches, probe, description


def bench_lr(args, device):
    import copy

    from adept_ext.lr import DecoupledLR, param_groups
    from adept_ext.optim import GroupedAdamW
    from adept_ext.report import plot_unit_rates
    from adept_ext.units import UnitImportance

    model, chosen, train_batches, probe, description = lr_setup(args, device)
    # On a GPU the steps run under bf16 autocast, as the training runner does, and the recompute is
    # timed both as DecoupledLR calls it by default (fp32) and in the training's precision.
    autocast = torch.bfloat16 if device.type == "cuda" else None
    plain_model = copy.deepcopy(model).train()
    plain_opt = torch.optim.AdamW([p for p in plain_model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    ours_model = copy.deepcopy(model).train()
    # The same per-unit groups with GroupedAdamW (what the runners use): one multi-tensor pass for every group.
    grouped_model = copy.deepcopy(model).train()
    del model
    ours_opt = torch.optim.AdamW(param_groups(ours_model, 1e-4, weight_decay=0.01))
    grouped_opt = GroupedAdamW(param_groups(grouped_model, 1e-4, weight_decay=0.01))
    importance = UnitImportance(ours_model, probe)
    decoupled = DecoupledLR(ours_opt, importance, every=10**9, autocast_dtype=autocast)  # no recompute in the steps
    DecoupledLR(grouped_opt, UnitImportance(grouped_model, probe), every=10**9, autocast_dtype=autocast)

    def step(m, opt, batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = m(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        opt.step()

    times = {"plain": [], "decoupled": [], "grouped": []}
    for i, batch in enumerate(train_batches):  # interleaved, so that machine noise hits all alike
        for name, m, opt in (("plain", plain_model, plain_opt), ("decoupled", ours_model, ours_opt),
                             ("grouped", grouped_model, grouped_opt)):
            sync(device)
            start = time.perf_counter()
            step(m, opt, batch)
            sync(device)
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    plain_s, ours_s = statistics.median(times["plain"]), statistics.median(times["decoupled"])
    grouped_s = statistics.median(times["grouped"])
    grouped_equal = all(torch.equal(a, b) for a, b in zip(ours_model.parameters(), grouped_model.parameters()))
    assert grouped_equal, "GroupedAdamW and AdamW trained different weights"
    del plain_model, plain_opt, grouped_model, grouped_opt

    repeats = 1 if args.quick else 3
    fused_recompute = median_time(lambda: importance.raw_scores(), device, repeats, 1)
    plain_recompute_s = median_time(lambda: plain_recompute(ours_model, importance.units, probe), device, repeats, 1)
    torch.testing.assert_close(torch.tensor(importance.raw_scores()),
                               torch.tensor(plain_recompute(ours_model, importance.units, probe), dtype=torch.float32),
                               rtol=1e-3, atol=1e-12)
    decoupled.recompute()
    mult = decoupled.multipliers
    results = {
        "model": description, "expanded_layers": ours_model.config.adept["expanded_layers"], "units": len(mult),
        "autocast": str(autocast).replace("torch.", "") if autocast else None,
        "plain_step_s": plain_s, "decoupled_step_s": ours_s, "adamw_groups_step_overhead": ours_s / plain_s - 1,
        "grouped_step_s": grouped_s, "step_overhead": grouped_s / plain_s - 1,
        "grouped_weights_equal_adamw": grouped_equal,
        "recompute_fused_s": fused_recompute, "recompute_plain_s": plain_recompute_s,
        "recompute_speedup": plain_recompute_s / fused_recompute,
    }
    if autocast:
        results["recompute_fused_autocast_s"] = median_time(
            lambda: importance.raw_scores(autocast_dtype=autocast), device, repeats, 1)
        results["recompute_plain_autocast_s"] = median_time(
            lambda: plain_recompute(ours_model, importance.units, probe, autocast), device, repeats, 1)
        results["recompute_autocast_speedup_vs_fp32"] = fused_recompute / results["recompute_fused_autocast_s"]
        results["recompute_autocast_speedup_vs_plain"] = (results["recompute_plain_autocast_s"]
                                                          / results["recompute_fused_autocast_s"])
    results["mean_multiplier_after_recompute"] = decoupled.mean_multiplier
    results["rates"] = {u.name: m for u, m in zip(importance.units, mult)}
    for normalize in ("per_kind", "global", "rank"):
        imp = UnitImportance(ours_model, probe, normalize=normalize, autocast_dtype=autocast)
        results[f"mean_multiplier_{normalize}"] = sum(max(2 * (1 - s), decoupled.floor) for s in imp.compute()) / len(mult)
    source_scores = importance.compute(use_source=True, autocast_dtype=autocast)
    results["mean_multiplier_source_scores"] = sum(max(2 * (1 - s), decoupled.floor) for s in source_scores) / len(mult)
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else "bench-results"
    os.makedirs(out_dir, exist_ok=True)
    results["heatmap"] = os.path.join(out_dir, f"unit_rates{'_large' if args.size == 'large' else ''}.png")
    plot_unit_rates(importance.units, mult, results["heatmap"],
                    title=f"ADEPT per-unit lr multipliers, {description.split(',')[0]}, copies of {chosen}")

    print(f"\nDecoupledLR on {description}, expanded at {chosen} ({len(mult)} units), AdamW, device {device}"
          f"{', bf16 autocast' if autocast else ''}")
    print(f"step: one group {plain_s * 1e3:.0f} ms; per-unit groups with DecoupledLR: torch AdamW {ours_s * 1e3:.0f} ms "
          f"({results['adamw_groups_step_overhead'] * 100:+.1f}%), GroupedAdamW {grouped_s * 1e3:.0f} ms "
          f"({results['step_overhead'] * 100:+.1f}%; same weights: {grouped_equal})")
    print(f"recompute on the probe batches: fused {fused_recompute:.2f} s, plain per-tensor {plain_recompute_s:.2f} s "
          f"-> speedup {results['recompute_speedup']:.2f}x")
    if autocast:
        print(f"recompute under bf16 autocast: fused {results['recompute_fused_autocast_s']:.2f} s "
              f"({results['recompute_autocast_speedup_vs_fp32']:.2f}x the fp32 one), plain per-tensor "
              f"{results['recompute_plain_autocast_s']:.2f} s")
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


def random_basis_rows(n, k, device, seed=0):
    """k rows of n float32 values ~ N(0, 1/n): nearly orthonormal (inner products ~ n^-1/2), and
    generated again identically from the seed, so that the flat [k, n] basis and the per-tensor
    storage need not exist at once (at 487M elements and k = 32 each is 62 GB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(k):
        yield torch.randn(n, device=device, generator=gen).div_(math.sqrt(n))


def memory_of_random_rows(params, k, device):
    """A GradientMemory of `params` whose k directions are `random_basis_rows` (the rows of the flat
    [k, n] basis, split per parameter)."""
    from adept_ext.projection import GradientMemory

    sizes = [p.numel() for p in params]
    memory = GradientMemory(params, max_directions=k)
    for j, basis_row in enumerate(random_basis_rows(sum(sizes), k, device)):
        for s, part in zip(memory.storage, basis_row.split(sizes)):
            s[j].copy_(part.view_as(s[j]))
    memory.k = k
    return memory


def bench_projection(args, device):
    large = args.size == "large"
    shapes = llama1b_layer_shapes(2 if args.quick else 8) if large else projection_shapes()
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    ks = (8, 32) if args.quick or large else (8, 32, 64)
    repeats = 2 if args.quick else 3
    grads = [torch.randn(s, device=device) for s in shapes]
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    results = {"tensors": len(shapes), "elements": n, "by_k": {}}

    def eoupct_style(memory_rows, k, tensors):
        m = torch.stack(memory_rows, dim=1)  # re-stacked every step
        inv = torch.inverse(m.T @ m + 1e-4 * torch.eye(k, device=device))
        g = torch.cat([t.reshape(-1) for t in tensors])
        g = g - m @ (inv @ (m.T @ g))
        for t, part in zip(tensors, g.split(sizes)):
            t.copy_(part.view_as(t))

    def torch_cached(q, tensors):
        g = torch.cat([t.reshape(-1) for t in tensors])
        g -= q.T @ (q @ g)
        for t, part in zip(tensors, g.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    for k in ks:
        q = torch.empty(k, n, device=device)  # [k, n], cached basis
        for j, row in enumerate(random_basis_rows(n, k, device)):
            q[j] = row
        nbytes = 2 * n * k * 4 + 3 * n * 4
        probe = torch.randn(min(nbytes, 2 << 30) // 4, device=device)
        t_probe = median_time(lambda: torch.sum(probe), device, repeats) * nbytes / (probe.numel() * 4)
        del probe
        row = {"bandwidth_probe_s": t_probe}
        if not large:  # the EoupCT form re-stacks the memory: another [n, k] copy (62 GB at the large size)
            rows = list(q.unbind(0))
            row["eoupct_style_s"] = median_time(lambda: eoupct_style(rows, k, grads), device, repeats, 1)
            row["extra_peak_mb_eoupct_style"] = peak_mb(lambda: eoupct_style(rows, k, grads), device)
            del rows
        row["torch_cached_s"] = median_time(lambda: torch_cached(q, grads), device, repeats, 1)
        row["extra_peak_mb_torch_cached"] = peak_mb(lambda: torch_cached(q, grads), device)
        expected = [g.clone() for g in grads]
        torch_cached(q, expected)
        del q
        memory = memory_of_random_rows(params, k, device)  # the same rows, per tensor
        check = [g.clone() for g in grads]
        memory.project_(check)
        torch.testing.assert_close(torch.cat([c.reshape(-1) for c in check]),
                                   torch.cat([e.reshape(-1) for e in expected]), rtol=1e-4, atol=1e-4)
        del check, expected
        t_ours = median_time(lambda: memory.project_(grads), device, repeats, 1)
        row["extra_peak_mb_fused"] = peak_mb(lambda: memory.project_(grads), device)
        del memory
        row.update({"fused_s": t_ours, "speedup_vs_torch_cached": row["torch_cached_s"] / t_ours,
                    "fused_gbps": nbytes / t_ours / 1e9, "bandwidth_probe_gbps": nbytes / t_probe / 1e9,
                    "grads_mb": n * 4 / 2**20})
        if "eoupct_style_s" in row:
            row["speedup_vs_eoupct_style"] = row["eoupct_style_s"] / t_ours
        row["bandwidth_fraction"] = row["fused_gbps"] / row["bandwidth_probe_gbps"]
        if nominal_gbps(device):
            row["nominal_bandwidth_fraction"] = row["fused_gbps"] / nominal_gbps(device)
        results["by_k"][str(k)] = row

    results["fixed_cost"] = projection_fixed_cost(len(shapes), device, torch_cached, repeats)

    def cell(r, key, fmt, scale=1.0):
        return format(r[key] * scale, fmt) if key in r else format("-", ">" + fmt.split(".")[0])

    print(f"\nnull-space projection of {n / 1e6:.1f}M float32 gradients in {len(shapes)} tensors, device {device}; "
          "bandwidth bytes = 2nk*4 + 3n*4")
    print(f"{'k':>3} {'eoupct ms':>10} {'cached ms':>10} {'fused ms':>9} {'x eoupct':>9} {'x cached':>9} "
          f"{'GB/s':>6} {'bw frac':>8} {'+MB eoupct':>10} {'+MB cached':>10} {'+MB fused':>9}")
    for k, r in results["by_k"].items():
        print(f"{k:>3} {cell(r, 'eoupct_style_s', '10.1f', 1e3)} {r['torch_cached_s'] * 1e3:10.1f} "
              f"{r['fused_s'] * 1e3:9.1f} {cell(r, 'speedup_vs_eoupct_style', '9.2f')} "
              f"{r['speedup_vs_torch_cached']:9.2f} {r['fused_gbps']:6.1f} {r['bandwidth_fraction']:8.2f} "
              f"{cell(r, 'extra_peak_mb_eoupct_style', '10.0f')} {r['extra_peak_mb_torch_cached']:10.0f} "
              f"{r['extra_peak_mb_fused']:9.1f}")
    fixed = results["fixed_cost"]
    print(f"fixed cost per call ({fixed['tensors']} one-element tensors, k {fixed['k']}): cached torch "
          f"{fixed['torch_cached_s'] * 1e6:.0f} us, adept_ext {fixed['fused_s'] * 1e6:.0f} us")
    return results


def projection_fixed_cost(n_tensors, device, torch_cached, repeats):
    """Seconds per projection call on n one-element tensors (k = 8): the host and launch cost
    that a call pays whatever the tensors' size (checks, dispatch, launches, the finiteness check's
    sync), for GradientMemory.project_ and for the cached-basis torch form."""
    k = 8
    params = [torch.nn.Parameter(torch.zeros(1, device=device)) for _ in range(n_tensors)]
    grads = [torch.randn(1, device=device) for _ in range(n_tensors)]
    memory = memory_of_random_rows(params, k, device)
    q = torch.stack(list(random_basis_rows(n_tensors, k, device)))
    calls = 200

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    return {"tensors": n_tensors, "k": k,
            "torch_cached_s": median_time(many(lambda: torch_cached(q, grads)), device, repeats, 1) / calls,
            "fused_s": median_time(many(lambda: memory.project_(grads)), device, repeats, 1) / calls}


# ---------------------------------------------------------------- linear_ce
# (N, H, V, dtype): SmolLM2-135M's head on 2 CPU cores; a Llama-3 vocabulary at 8 x 1024 tokens.
LCE_SHAPES = {"small": (1024, 576, 49152, torch.float32), "large": (8192, 2048, 128256, torch.bfloat16)}


def lce_peers(device):
    """The peers a user would pick instead, when installed (never dependencies): name -> fn(h, w, t)
    returning the loss summed over the non-ignored rows. Both are Triton kernels: GPU only."""
    peers = {}
    if device.type != "cuda":
        return peers
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        peers["cut_cross_entropy"] = lambda h, w, t: cce(h, w, t, reduction="sum")
    except ImportError:
        pass
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        def liger_sum(h, w, t):
            out = liger(h, w, t, reduction="sum")
            return out[0] if isinstance(out, tuple) else out  # some versions also return the z-loss

        peers["liger_fused_linear_ce"] = liger_sum
    except ImportError:
        pass
    return peers


def reference_lce_sum(hidden, weight, targets, rows=1024):
    """Σ of reference.linear_cross_entropy (float64), `rows` rows at a time (its logits are float64)."""
    return sum(float(reference.linear_cross_entropy(h, weight, t).sum())
               for h, t in zip(hidden.split(rows), targets.split(rows)))


def bench_linear_ce(args, device):
    """linear_cross_entropy vs logits + cross_entropy in torch, the GEMM alone, and the installed peers."""
    n, h, v, dtype = LCE_SHAPES[args.size]
    if args.quick:
        n //= 4
    repeats = (3 if args.quick else 10) * (5 if device.type == "cuda" else 1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * h ** -0.5).to(device, dtype)  # logits ~ N(0, 1)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::17] = -100
    targets = targets.to(device)
    exact = reference_lce_sum(hidden, weight, targets)

    def torch_lce(hh, ww, tt):  # what a user writes (HF upcasts the logits to float32)
        return torch.nn.functional.cross_entropy((hh @ ww.T).float(), tt, reduction="none")

    providers = {"torch": torch_lce, "adept_ext": adept_ext.linear_cross_entropy}
    if args.size == "large":
        for rows in (1024, 8192):
            providers[f"adept_ext_chunk_rows_{rows}"] = (
                lambda hh, ww, tt, rows=rows: adept_ext.linear_cross_entropy(hh, ww, tt, chunk_rows=rows))
    peers = lce_peers(device)
    providers.update(peers)
    flops = 2 * n * h * v
    t_gemm = median_time(lambda: hidden @ weight.T, device, repeats)
    results = {"n": n, "h": h, "v": v, "dtype": str(dtype).replace("torch.", ""), "gemm_s": t_gemm,
               "gemm_tflops": flops / t_gemm / 1e12, "peak_mem_gemm_mb": peak_mb(lambda: hidden @ weight.T, device),
               "default_chunk_rows": adept_ext.ops.default_chunk_rows(v, device, dtype),
               "peers_installed": sorted(peers), "providers": {}}
    with torch.no_grad():
        for name, fn in providers.items():
            try:
                got = float(fn(hidden, weight, targets).double().sum())
                t = median_time(lambda: fn(hidden, weight, targets), device, repeats)
                mem = peak_mb(lambda: fn(hidden, weight, targets), device)
            except Exception as e:  # an optional peer's version may not fit: reported, not fatal
                if name not in peers:
                    raise
                results["providers"][name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"warning: {name} failed: {type(e).__name__}: {e}")
                continue
            results["providers"][name] = {"s": t, "tflops": flops / t / 1e12, "gemm_fraction": t_gemm / t,
                                          "peak_mem_mb": mem, "rel_diff_loss_sum": abs(got - exact) / abs(exact)}
    ours = results["providers"]["adept_ext"]["s"]
    for r in results["providers"].values():
        if "s" in r:
            r["time_vs_adept_ext"] = r["s"] / ours  # > 1: adept_ext is faster

    print(f"\nlinear_cross_entropy, N {n} x H {h} x V {v}, {results['dtype']}, device {device} "
          f"(default chunk {results['default_chunk_rows']} rows); GEMM alone {t_gemm * 1e3:.2f} ms "
          f"= {results['gemm_tflops']:.2f} TFLOP/s, peak +{results['peak_mem_gemm_mb']:.0f} MB")
    print(f"{'provider':28} {'ms':>9} {'TFLOP/s':>8} {'GEMM frac':>9} {'x adept':>8} {'+MB':>8} {'rel diff':>9}")
    for name, r in results["providers"].items():
        if "s" not in r:
            print(f"{name:28} {r['error']}")
            continue
        print(f"{name:28} {r['s'] * 1e3:9.2f} {r['tflops']:8.2f} {r['gemm_fraction']:9.2f} "
              f"{r['time_vs_adept_ext']:8.2f} {r['peak_mem_mb']:8.0f} {r['rel_diff_loss_sum']:9.1e}")
    if device.type == "cuda" and not peers:
        print("(cut-cross-entropy / liger-kernel not installed: no peer columns)")
    return results


# ---------------------------------------------------------------- probe scaling (torchrun-style)
def _probe_rank(rank, world, port, n_blocks, threads, queue):
    """One process of the scaling run: gloo group of `world`, `threads` threads, the exact probe."""
    import torch.distributed as dist

    from adept_ext.probe import layer_importance

    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, batches = probe_setup(n_blocks, torch.device("cpu"), batch_size=2)
        layer_importance(model, batches[:world], progress=False)  # warm-up, the same calls on every rank
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        result = layer_importance(model, batches, progress=False)
        seconds = time.perf_counter() - start
        if rank == 0:
            queue.put({"seconds": seconds, "scores": result.scores})
    finally:
        if world > 1:
            dist.destroy_process_group()


def bench_probe_scaling(args, device):
    """The exact probe on the same batches in 1 process and in W gloo processes (the threads split
    evenly), as `torchrun` runs it: each rank probes batches[rank::W] and the sums are all-reduced."""
    if device.type != "cpu":
        sys.exit("probe_scaling runs on the CPU (gloo); on GPUs run the probe under torchrun")
    n_blocks, world = (4, 2) if args.quick else (8, 2)
    cores = os.cpu_count() or 1
    ctx = mp.get_context("spawn")
    results = {"blocks": n_blocks, "block_len": 128, "batch_size": 2, "processes": world, "cores": cores}
    for w in (1, world):
        queue = ctx.Queue()
        port = 29600 + w
        procs = [ctx.Process(target=_probe_rank, args=(r, w, port, n_blocks, max(1, cores // w), queue))
                 for r in range(w)]
        for proc in procs:
            proc.start()
        out = queue.get(timeout=1800)
        for proc in procs:
            proc.join()
        results[f"{w}_process_s"] = out["seconds"]
        results[f"{w}_process_scores"] = out["scores"]
    results["speedup"] = results["1_process_s"] / results[f"{world}_process_s"]
    results["max_abs_diff_scores"] = max(abs(a - b) for a, b in zip(results["1_process_scores"],
                                                                      results[f"{world}_process_scores"]))
    print(f"\nexact probe, SmolLM2-135M, {n_blocks} blocks x 128 tokens in batches of 2, {cores} cores: "
          f"1 process {results['1_process_s']:.1f} s, {world} gloo processes {results[f'{world}_process_s']:.1f} s "
          f"-> {results['speedup']:.2f}x; max |score difference| {results['max_abs_diff_scores']:.1e}")
    return results


# ---------------------------------------------------------------- corpus
CORPUS_CHILD = r"""
import json, resource, sys, time
from transformers import AutoTokenizer
from adept_ext import data
from adept_ext.models import resolve_checkpoint
path, mode, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
start = time.perf_counter()
if mode == "today":  # what adept-ext run did before large_corpus: every text, then every block, in memory
    blocks = data.token_blocks(data.load_texts(path), tokenizer, 128)
    n_blocks, tokens = blocks["input_ids"].shape[0], int(blocks["attention_mask"].sum())
else:
    blocks = data.corpus_blocks(path, tokenizer, 128, workers)
    n_blocks, tokens = len(blocks), len(blocks.stream)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "blocks": n_blocks, "tokens": tokens,
                  "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def generated_corpus(megabytes, root):
    """`megabytes` MB of JSONL (8 files) of BBC News, Python docs and Python source documents drawn
    at random (seed 0): real text, so the tokenizer works as hard as on a user's corpus."""
    import random

    from adept_ext import data

    folder = os.path.join(root, f"corpus-{megabytes}mb")
    if os.path.isdir(folder):
        return folder
    texts = [json.dumps({"text": t}) + "\n" for name in data.BUILTIN_CORPORA for t in data.load_texts(name)]
    rng, target = random.Random(0), megabytes * 2 ** 20
    os.makedirs(folder + ".tmp", exist_ok=True)
    written = 0
    for i in range(8):
        with open(os.path.join(folder + ".tmp", f"part-{i}.jsonl"), "w") as f:
            while written < target * (i + 1) / 8:
                line = rng.choice(texts)
                f.write(line)
                written += len(line.encode())
    os.replace(folder + ".tmp", folder)
    return folder


def measure_corpus_load(path, mode, workers, cache, limit_mb):
    """Run one load in a fresh process (its own datasets cache); its wall time, tokens/s and peak
    resident memory (polled; the process is killed above `limit_mb`, reported as not finished)."""
    import subprocess

    env = {**os.environ, "HF_DATASETS_CACHE": cache, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CORPUS_CHILD, path, mode, str(workers)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak, started = 0.0, time.perf_counter()
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            rss = 0.0
        peak = max(peak, rss)
        if peak > limit_mb:
            proc.kill()
            proc.wait()
            return {"mode": mode, "finished": False, "killed_above_mb": limit_mb,
                    "seconds_until_killed": round(time.perf_counter() - started, 1)}
        time.sleep(0.1)
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0 or not out:
        return {"mode": mode, "finished": False, "returncode": proc.returncode}
    result = json.loads(out[-1])
    return {"mode": mode, "finished": True, "workers": workers, "seconds": round(result["seconds"], 1),
            "tokens": result["tokens"], "blocks": result["blocks"],
            "tokens_per_second": round(result["tokens"] / result["seconds"]), "peak_rss_mb": round(peak),
            "worker_peak_rss_mb": round(result["worker_peak_rss_mb"])}


def bench_corpus(args, device):
    """Tokenising a generated corpus into 128-token blocks: the in-memory path (every text, then
    every block, in one process) vs large_corpus (datasets map with `workers` processes, cached
    on disk, packed into a memory-mapped stream), each in a fresh process with a fresh cache;
    then the same load again (the cache hit)."""
    import tempfile

    sizes = [16] if args.quick else [100, 1024]
    workers = os.cpu_count() or 1
    limit_mb = 16 * 1024
    root = os.environ.get("ADEPT_EXT_BENCH_DIR", os.path.join(tempfile.gettempdir(), "adept-ext-bench"))
    rows = []
    for megabytes in sizes:
        path = generated_corpus(megabytes, root)
        with tempfile.TemporaryDirectory(dir=root) as cache:
            row = {"corpus_mb": megabytes,
                   "today": measure_corpus_load(path, "today", workers, cache, limit_mb),
                   "datasets": measure_corpus_load(path, "datasets", workers, cache, limit_mb),
                   "datasets_cached": measure_corpus_load(path, "datasets", workers, cache, limit_mb)}
        today, new = row["today"], row["datasets"]
        if today["finished"] and new["finished"]:
            row["speedup"] = round(today["seconds"] / new["seconds"], 2)
            row["rss_ratio"] = round(today["peak_rss_mb"] / max(new["peak_rss_mb"], 1), 1)
        print(json.dumps(row))
        rows.append(row)
    return {"limit_mb": limit_mb, "rows": rows}


BENCHMARKS = {"importance": bench_importance, "probe": bench_probe, "lr": bench_lr, "projection": bench_projection,
              "lens": bench_lens, "linear_ce": bench_linear_ce, "placement": bench_placement,
              "probe_scaling": bench_probe_scaling, "eoupct_step": bench_eoupct_step,
              "corpus": bench_corpus}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--size", choices=("small", "large"), default="small",
                        help="small: the CPU sizes (default); large: realistic GPU sizes (see above)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and adept_ext.cuda_available()):
        sys.exit("--device cuda: no GPU, or adept_ext was built without CUDA kernels")
    names = list(BENCHMARKS) if args.benchmark == "all" else [args.benchmark]
    if args.size == "large":
        names = [name for name in names if name != "lens"]
    if args.benchmark == "all" and (device.type != "cpu" or args.size == "large"):
        names = [name for name in names if name not in ("probe_scaling", "corpus")]  # CPU measurements
    if args.size == "large" and args.benchmark == "lens":
        sys.exit("lens has one size (SmolLM2-135M)")
    results = {"machine": machine_info(device, args.size)}
    for name in names:
        results[name] = BENCHMARKS[name](args, device)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
