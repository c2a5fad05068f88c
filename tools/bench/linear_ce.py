"""linear_cross_entropy (the LM head's GEMM fused with cross-entropy, in row chunks) against the
torch a user writes (F.linear, logits upcast to float32, then cross_entropy), the GEMM alone, and the
peers a user would pick instead when installed: cut-cross-entropy and Liger's fused linear
cross-entropy (GPU only). Two parts: the forward under no_grad, and the head's part of a training
step (forward+backward: the mean loss over the non-ignored rows and its gradients)."""
import functools
import importlib

import torch

import adept_ext
from adept_ext import reference
from bench.common import dtype_name, interleaved_median_times, median_time, peak_mb, row

IGNORE = -100
# The forward: (N, H, V, dtype): SmolLM2-135M's head on 2 CPU cores; a Llama-3 vocabulary at 8 x 1024 tokens.
LCE_SHAPES = {"small": (1024, 576, 49152, torch.float32), "large": (8192, 2048, 128256, torch.bfloat16)}
# The training step: the heads of the models users train, by model; 8 x 1024 tokens in bf16 on a GPU.
TRAIN_SHAPES = {"small": {"smollm2-135m": (2048, 576, 49152, torch.float32)},
                "large": {"llama-3.2-1b": (8192, 2048, 128256, torch.bfloat16),
                          "llama-3.1-8b": (8192, 4096, 128256, torch.bfloat16),
                          "qwen3-1.7b": (8192, 2048, 151936, torch.bfloat16)}}


# ---------------------------------------------------------------- the providers: fn(h, w, t, reduction)
# reduction "sum" (over the non-ignored rows) or "mean" (over the non-ignored rows: the training loss).
# Module-level functions, so that a fresh process measuring the peak memory can be handed one.
def torch_loss(h, w, t, reduction):  # what a user writes (HF upcasts the logits to float32)
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), t, reduction=reduction)


def adept_loss(h, w, t, reduction, chunk_rows=None):  # the public op, reduced: gradients in the forward
    return adept_ext.linear_cross_entropy(h, w, t, chunk_rows=chunk_rows, reduction=reduction)


def adept_rows_loss(h, w, t, reduction):  # per-row losses, the backward recomputes the logits
    rows = adept_ext.linear_cross_entropy(h, w, t)
    return rows.sum() if reduction == "sum" else rows.sum() / (t != IGNORE).sum()


def cce_loss(h, w, t, reduction):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, t, reduction=reduction)


def liger_loss(h, w, t, reduction):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(h, w, t, reduction=reduction)
    return out[0] if isinstance(out, tuple) else out  # some versions also return the z-loss


# name -> (the module it needs, its fn); never dependencies.
PEERS = {"cut_cross_entropy": ("cut_cross_entropy", cce_loss),
         "liger_fused_linear_ce": ("liger_kernel.transformers.functional", liger_loss)}


def peer_status(module, device):
    """None when the peer runs here, else why not (both peers are Triton kernels: GPU only)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"not installed ({e})"
    except Exception as e:  # installed, but a version that does not fit this torch or Triton
        return f"not importable ({type(e).__name__}: {e})"
    return None if device.type == "cuda" else "GPU only (a Triton kernel)"


def lce_peers(device):
    """(name -> fn of the peers that run here, name -> why not of the others)."""
    status = {name: peer_status(module, device) for name, (module, _) in PEERS.items()}
    return ({name: PEERS[name][1] for name, why in status.items() if why is None},
            {name: why for name, why in status.items() if why is not None})


def lce_inputs(n, h, v, dtype, device, requires_grad=False):
    """Hidden states, a weight giving logits ~ N(0, 1), and targets with every 17th row ignored."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * h ** -0.5).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::17] = IGNORE
    return hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad), targets.to(device)


def reference_lce_sum(hidden, weight, targets, rows=1024):
    """Σ of reference.linear_cross_entropy (float64), `rows` rows at a time (its logits are float64)."""
    return sum(float(reference.linear_cross_entropy(h, weight, t).sum())
               for h, t in zip(hidden.split(rows), targets.split(rows)))


def rel_diff(got, want):
    """max |got - want| / max |want|."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


# ---------------------------------------------------------------- the forward
def forward(args, device, peers, skipped):
    n, h, v, dtype = LCE_SHAPES[args.size]
    if args.quick:
        n //= 4
    repeats = (3 if args.quick else 10) * (5 if device.type == "cuda" else 1)
    hidden, weight, targets = lce_inputs(n, h, v, dtype, device)
    exact = reference_lce_sum(hidden, weight, targets)

    providers = {"torch": torch_loss, "adept_ext": adept_loss}
    if args.size == "large":
        for chunk in (1024, 8192):
            providers[f"adept_ext_chunk_rows_{chunk}"] = functools.partial(adept_loss, chunk_rows=chunk)
    providers.update(peers)
    flops = 2 * n * h * v
    t_gemm = median_time(lambda: hidden @ weight.T, device, repeats)
    results = {"n": n, "h": h, "v": v, "dtype": dtype_name(dtype), "gemm_s": t_gemm,
               "gemm_tflops": flops / t_gemm / 1e12, "peak_mem_gemm_mb": peak_mb(lambda: hidden @ weight.T, device),
               "default_chunk_rows": adept_ext.ops.default_chunk_rows(v, device, dtype),
               "peers_installed": sorted(peers),
               "providers": {name: {"skipped": why} for name, why in skipped.items()}}
    with torch.no_grad():
        for name, fn in providers.items():
            try:
                call = functools.partial(fn, hidden, weight, targets, "sum")
                got = float(call().double())
                t = median_time(call, device, repeats)
                mem = peak_mb(call, device)
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

    print(f"\nlinear_cross_entropy forward, N {n} x H {h} x V {v}, {results['dtype']}, device {device} "
          f"(default chunk {results['default_chunk_rows']} rows); GEMM alone {t_gemm * 1e3:.2f} ms "
          f"= {results['gemm_tflops']:.2f} TFLOP/s, peak +{results['peak_mem_gemm_mb']:.0f} MB")
    print(f"{'provider':28} {'ms':>9} {'TFLOP/s':>8} {'GEMM frac':>9} {'x adept':>8} {'+MB':>8} {'rel diff':>9}")
    for name, r in results["providers"].items():
        if "s" in r:
            print(f"{name:28} {r['s'] * 1e3:9.2f} {r['tflops']:8.2f} {r['gemm_fraction']:9.2f} "
                  f"{r['time_vs_adept_ext']:8.2f} {r['peak_mem_mb']:8.0f} {r['rel_diff_loss_sum']:9.1e}")
        else:
            print(f"{name:28} {r.get('error') or r['skipped']}")
    return results


# ---------------------------------------------------------------- the training step
def training_step(fn, hidden, weight, targets):
    """The head's part of a training step: (fn's mean loss over the non-ignored rows, its gradient
    for the hidden states, for the weight)."""
    loss = fn(hidden, weight, targets, "mean")
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def fresh_training_step(fn, shape, setup_only=False, state=None):
    """For peak_mb(fresh=...): the inputs of shape (N, H, V, dtype) on the CPU, after one tiny step
    (8 rows, V 64), so that what a first call loads once (modules it imports, code) is in the
    baseline; then one training step."""
    if setup_only:
        n, h, v, dtype = shape
        training_step(fn, *lce_inputs(8, h, 64, dtype, torch.device("cpu"), requires_grad=True))
        return lce_inputs(*shape, torch.device("cpu"), requires_grad=True)
    return training_step(fn, *state)


def forward_backward(label, shape, providers, peers, skipped, device, repeats):
    """Every provider's training step (providers: name -> fn, "torch" first) on inputs of shape
    (N, H, V, dtype): its median time over `repeats` interleaved rounds, its achieved TFLOP/s
    (the step's three GEMMs, 6·N·H·V FLOPs, whatever a provider recomputes), its peak extra memory
    (on a CPU in a fresh process), both as fractions of plain torch's, and how far its loss and
    gradients are from plain torch's. A peer (a name in `peers`) that fails is recorded, not fatal;
    `skipped` (name -> why) are recorded as not run."""
    n, h, v, dtype = shape
    hidden, weight, targets = lce_inputs(*shape, device, requires_grad=True)
    results = {"n": n, "h": h, "v": v, "dtype": dtype_name(dtype), "repeats": repeats,
               "providers": {name: {"skipped": why} for name, why in skipped.items()}}
    calls = {}
    for name, fn in providers.items():  # the agreement check; also the warm-up
        call = functools.partial(training_step, fn, hidden, weight, targets)
        try:
            loss, *grads = call()
        except Exception as e:  # an optional peer's version may not fit: reported, not fatal
            if name not in peers:
                raise
            results["providers"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"warning: {name} failed: {type(e).__name__}: {e}")
            continue
        if name == "torch":
            want_loss, want_grads = loss, grads
        calls[name] = call
        results["providers"][name] = {"rel_diff_loss_vs_torch": rel_diff(loss, want_loss),
                                      "max_rel_diff_grads_vs_torch": max(map(rel_diff, grads, want_grads))}
    del loss, grads
    for name, s in interleaved_median_times(calls, device, repeats, warmup=0).items():
        mem = peak_mb(calls[name], device, fresh=functools.partial(fresh_training_step, providers[name], shape))
        results["providers"][name].update(s=s, tflops=6 * n * h * v / s / 1e12, peak_mem_mb=mem)
    base = results["providers"]["torch"]
    for name in calls:
        r = results["providers"][name]
        r.update(time_vs_torch=r["s"] / base["s"], peak_mem_vs_torch=r["peak_mem_mb"] / base["peak_mem_mb"])

    print(f"\nlinear_cross_entropy forward+backward (mean loss, gradients for the hidden states and the weight), "
          f"{label}'s head: N {n} x H {h} x V {v}, {results['dtype']}, device {device}, median of {repeats} "
          f"interleaved repeats")
    print(f"{'provider':24} {'ms':>9} {'TFLOP/s':>8} {'x torch':>8} {'+MB':>8} {'mem x torch':>11} "
          f"{'loss diff':>9} {'grad diff':>9}")
    for name, r in results["providers"].items():
        if "s" in r:
            print(f"{name:24} {r['s'] * 1e3:9.2f} {r['tflops']:8.2f} {r['time_vs_torch']:8.2f} "
                  f"{r['peak_mem_mb']:8.0f} {r['peak_mem_vs_torch']:11.3f} {r['rel_diff_loss_vs_torch']:9.1e} "
                  f"{r['max_rel_diff_grads_vs_torch']:9.1e}")
        else:
            print(f"{name:24} {r.get('error') or r['skipped']}")
    return results


def run(args, device):
    peers, skipped = lce_peers(device)
    results = forward(args, device, peers, skipped)
    repeats = (3 if args.quick else 5) * (2 if device.type == "cuda" else 1)
    results["forward_backward"] = {
        label: forward_backward(label, (n // 4 if args.quick else n, h, v, dtype),
                                {"torch": torch_loss, "adept_ext": adept_loss, "adept_ext_per_row": adept_rows_loss,
                                 **peers}, peers, skipped, device,
                                repeats)
        for label, (n, h, v, dtype) in TRAIN_SHAPES[args.size].items()}
    return results


def rows(results):
    fields = {"dtype": results["dtype"], "shape": f"N {results['n']} x H {results['h']} x V {results['v']}"}
    out = [row("gemm_alone", "time", results["gemm_s"] * 1e3, "ms", **fields),
           row("gemm_alone", "tflops", results["gemm_tflops"], "TFLOP/s", **fields),
           row("gemm_alone", "peak_extra_memory", results["peak_mem_gemm_mb"], "MB", **fields)]
    for name, r in results["providers"].items():
        if "s" in r:
            out += [row(name, "time", r["s"] * 1e3, "ms", **fields),
                    row(name, "tflops", r["tflops"], "TFLOP/s", **fields),
                    row(name, "gemm_fraction", r["gemm_fraction"], "", **fields),
                    row(name, "time_vs_adept_ext", r["time_vs_adept_ext"], "x", **fields),
                    row(name, "peak_extra_memory", r["peak_mem_mb"], "MB", **fields),
                    row(name, "rel_diff_loss_sum", r["rel_diff_loss_sum"], "", **fields)]
    for fb in results["forward_backward"].values():
        fields = {"dtype": fb["dtype"], "shape": f"forward+backward, N {fb['n']} x H {fb['h']} x V {fb['v']}"}
        for name, r in fb["providers"].items():
            if "s" in r:
                out += [row(name, "time", r["s"] * 1e3, "ms", **fields),
                        row(name, "tflops", r["tflops"], "TFLOP/s", **fields),
                        row(name, "time_vs_torch", r["time_vs_torch"], "x", **fields),
                        row(name, "peak_extra_memory", r["peak_mem_mb"], "MB", **fields),
                        row(name, "peak_memory_vs_torch", r["peak_mem_vs_torch"], "x", **fields),
                        row(name, "rel_diff_loss_vs_torch", r["rel_diff_loss_vs_torch"], "", **fields),
                        row(name, "max_rel_diff_grads_vs_torch", r["max_rel_diff_grads_vs_torch"], "", **fields)]
    return out
