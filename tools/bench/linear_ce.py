"""linear_cross_entropy (the LM head's GEMM fused with cross-entropy, in row chunks) against the
torch a user writes (logits, then cross_entropy), the GEMM alone, and the peers a user would pick
instead when installed: cut-cross-entropy and Liger's fused linear cross-entropy (GPU only)."""
import functools

import torch

import adept_ext
from adept_ext import reference
from bench.common import dtype_name, median_time, peak_mb, row

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


def torch_lce(hh, ww, tt):  # what a user writes (HF upcasts the logits to float32)
    return torch.nn.functional.cross_entropy((hh @ ww.T).float(), tt, reduction="none")


def run(args, device):
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

    providers = {"torch": torch_lce, "adept_ext": adept_ext.linear_cross_entropy}
    if args.size == "large":
        for chunk in (1024, 8192):
            providers[f"adept_ext_chunk_rows_{chunk}"] = (
                lambda hh, ww, tt, chunk=chunk: adept_ext.linear_cross_entropy(hh, ww, tt, chunk_rows=chunk))
    peers = lce_peers(device)
    providers.update(peers)
    flops = 2 * n * h * v
    t_gemm = median_time(lambda: hidden @ weight.T, device, repeats)
    results = {"n": n, "h": h, "v": v, "dtype": dtype_name(dtype), "gemm_s": t_gemm,
               "gemm_tflops": flops / t_gemm / 1e12, "peak_mem_gemm_mb": peak_mb(lambda: hidden @ weight.T, device),
               "default_chunk_rows": adept_ext.ops.default_chunk_rows(v, device, dtype),
               "peers_installed": sorted(peers), "providers": {}}
    with torch.no_grad():
        for name, fn in providers.items():
            try:
                call = functools.partial(fn, hidden, weight, targets)
                got = float(call().double().sum())
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
    return out
