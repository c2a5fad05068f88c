#!/usr/bin/env python
"""Benchmarks of adept_ext kernels against the plain-PyTorch ways a user would write them,
measured in one run on the same data. Medians over repeats, after warm-up.

    python tools/bench.py importance [--quick] [--json PATH] [--device cpu|cuda]
"""
import argparse
import json
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


BENCHMARKS = {"importance": bench_importance}


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
