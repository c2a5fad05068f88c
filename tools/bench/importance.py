"""taylor_importance (θ·∇θ sums per tensor) against per-tensor torch, torch._foreach ops and a
bandwidth probe (torch.sum over a float32 buffer of the same bytes)."""
import functools

import torch

import adept_ext
from adept_ext import reference
from bench.common import dtype_name, llama1b_layer_shapes, median_time, nominal_gbps, qwen3_layer_shapes, row


def naive_importance(params, grads):
    return torch.stack([torch.stack([(p * g).sum(), (p * g).abs().sum()]) for p, g in zip(params, grads)])


def foreach_importance(params, grads):
    prods = torch._foreach_mul(params, grads)
    return torch.stack([torch.stack([x.sum() for x in prods]), torch.stack(torch._foreach_norm(prods, 1))], 1)


def run(args, device):
    if args.size == "large":
        shapes = llama1b_layer_shapes(2 if args.quick else 16)
    else:
        shapes = qwen3_layer_shapes(1 if args.quick else 4)
    repeats = (3 if args.quick else 10) * (5 if device.type == "cuda" else 1)
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        grads = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
        numel = sum(p.numel() for p in params)
        nbytes = 2 * numel * params[0].element_size()
        # The implementations must agree before they are timed; a float32 sum's error scales with Σ|θg|
        # (column 1), not with the signed sum, which cancels to near 0 on random data.
        exact = reference.taylor_importance(params, grads).cpu()
        error = (adept_ext.taylor_importance(params, grads).double().cpu() - exact).abs()
        allowed = 1e-5 * exact[:, 1:2] + 1e-3
        if (error > allowed).any():
            raise AssertionError(f"taylor_importance disagrees with the reference: error {error.max():.3g}")
        flat = torch.randn(nbytes // 4, device=device, dtype=torch.float32)

        t_naive, t_foreach, t_fused = (median_time(functools.partial(fn, params, grads), device, repeats)
                                       for fn in (naive_importance, foreach_importance, adept_ext.taylor_importance))
        t_probe = median_time(functools.partial(torch.sum, flat), device, repeats)
        r = {
            "tensors": len(params), "elements": numel, "bytes": nbytes,
            "naive_s": t_naive, "foreach_s": t_foreach, "fused_s": t_fused, "bandwidth_probe_s": t_probe,
            "speedup_vs_naive": t_naive / t_fused, "speedup_vs_foreach": t_foreach / t_fused,
            "fused_gbps": nbytes / t_fused / 1e9, "bandwidth_probe_gbps": nbytes / t_probe / 1e9,
        }
        r["bandwidth_fraction"] = r["fused_gbps"] / r["bandwidth_probe_gbps"]
        if nominal_gbps(device):
            r["nominal_gbps"] = nominal_gbps(device)
            r["nominal_bandwidth_fraction"] = r["fused_gbps"] / r["nominal_gbps"]
        results[dtype_name(dtype)] = r
        del params, grads, flat

    print(f"\ntaylor_importance on {len(shapes)} tensors ({results['float32']['elements'] / 1e6:.1f}M elements), "
          f"device {device}, {torch.get_num_threads()} threads; bandwidth probe = torch.sum over a float32 buffer "
          "of equal bytes")
    print(f"{'dtype':9} {'naive ms':>9} {'foreach ms':>10} {'fused ms':>9} {'x naive':>8} {'x foreach':>9} "
          f"{'fused GB/s':>10} {'probe GB/s':>10} {'bw frac':>8}")
    for name, r in results.items():
        print(f"{name:9} {r['naive_s'] * 1e3:9.2f} {r['foreach_s'] * 1e3:10.2f} {r['fused_s'] * 1e3:9.2f} "
              f"{r['speedup_vs_naive']:8.2f} {r['speedup_vs_foreach']:9.2f} {r['fused_gbps']:10.1f} "
              f"{r['bandwidth_probe_gbps']:10.1f} {r['bandwidth_fraction']:8.2f}")
    return results


def shape(r):
    return f"{r['tensors']} tensors, {r['elements'] / 1e6:.1f}M elements"


def rows(results):
    out = []
    for dtype, r in results.items():
        fields = {"dtype": dtype, "shape": shape(r)}
        for provider, key in (("torch_naive", "naive_s"), ("torch_foreach", "foreach_s"), ("adept_ext", "fused_s"),
                              ("bandwidth_probe", "bandwidth_probe_s")):
            out.append(row(provider, "time", r[key] * 1e3, "ms", **fields))
        out += [row("adept_ext", "speedup_vs_naive", r["speedup_vs_naive"], "x", **fields),
                row("adept_ext", "speedup_vs_foreach", r["speedup_vs_foreach"], "x", **fields),
                row("adept_ext", "bandwidth", r["fused_gbps"], "GB/s", **fields),
                row("bandwidth_probe", "bandwidth", r["bandwidth_probe_gbps"], "GB/s", **fields),
                row("adept_ext", "bandwidth_fraction", r["bandwidth_fraction"], "", **fields)]
        if "nominal_bandwidth_fraction" in r:
            out.append(row("adept_ext", "nominal_bandwidth_fraction", r["nominal_bandwidth_fraction"], "", **fields))
    return out
