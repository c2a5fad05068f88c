"""Null-space projection of a gradient list: GradientMemory.project_ against the EoupCT code's form
(re-stack the memory, invert MᵀM, flatten, project, copy back, every step) and the best plain
torch form (a cached [k, n] basis, the gradient flattened); bytes = 2·n·k·4 + 3·n·4. Also the
fixed cost of a call (one-element tensors: checks, dispatch, launches, the finiteness sync)."""
import functools
import math

import torch

from bench.common import llama1b_layer_shapes, median_time, nominal_gbps, peak_mb, row


def projection_shapes():
    """8 decoder layers (hidden 448, intermediate 1200, q/k/v biases, 2 norms): 96 tensors, 19.3M elements."""
    h, inter = 448, 1200
    layer = [(h, h), (h, h), (h, h), (h, h), (h,), (h,), (h,), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * 8


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


def run(args, device):
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
        for j, basis_row in enumerate(random_basis_rows(n, k, device)):
            q[j] = basis_row
        nbytes = 2 * n * k * 4 + 3 * n * 4
        probe = torch.randn(min(nbytes, 2 << 30) // 4, device=device)
        t_probe = median_time(functools.partial(torch.sum, probe), device, repeats) * nbytes / (probe.numel() * 4)
        del probe
        r = {"bandwidth_probe_s": t_probe}
        if not large:  # the EoupCT form re-stacks the memory: another [n, k] copy (62 GB at the large size)
            call = functools.partial(eoupct_style, list(q.unbind(0)), k, grads)
            r["eoupct_style_s"] = median_time(call, device, repeats, 1)
            r["extra_peak_mb_eoupct_style"] = peak_mb(call, device)
            del call
        call = functools.partial(torch_cached, q, grads)
        r["torch_cached_s"] = median_time(call, device, repeats, 1)
        r["extra_peak_mb_torch_cached"] = peak_mb(call, device)
        del call
        expected = [g.clone() for g in grads]
        torch_cached(q, expected)
        del q
        memory = memory_of_random_rows(params, k, device)  # the same rows, per tensor
        check = [g.clone() for g in grads]
        memory.project_(check)
        torch.testing.assert_close(torch.cat([c.reshape(-1) for c in check]),
                                   torch.cat([e.reshape(-1) for e in expected]), rtol=1e-4, atol=1e-4)
        del check, expected
        call = functools.partial(memory.project_, grads)
        t_ours = median_time(call, device, repeats, 1)
        r["extra_peak_mb_fused"] = peak_mb(call, device)
        del memory, call
        r.update({"fused_s": t_ours, "speedup_vs_torch_cached": r["torch_cached_s"] / t_ours,
                  "fused_gbps": nbytes / t_ours / 1e9, "bandwidth_probe_gbps": nbytes / t_probe / 1e9,
                  "grads_mb": n * 4 / 2**20})
        if "eoupct_style_s" in r:
            r["speedup_vs_eoupct_style"] = r["eoupct_style_s"] / t_ours
        r["bandwidth_fraction"] = r["fused_gbps"] / r["bandwidth_probe_gbps"]
        if nominal_gbps(device):
            r["nominal_bandwidth_fraction"] = r["fused_gbps"] / nominal_gbps(device)
        results["by_k"][str(k)] = r

    results["fixed_cost"] = fixed_cost(len(shapes), device, torch_cached, repeats)

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


def fixed_cost(n_tensors, device, torch_cached, repeats):
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


def rows(results):
    out = []
    for k, r in results["by_k"].items():
        fields = {"dtype": "float32", "shape": f"{results['tensors']} tensors, {results['elements'] / 1e6:.1f}M "
                                               f"elements, k {k}"}
        for provider, suffix in (("eoupct_style", "eoupct_style"), ("torch_cached", "torch_cached"),
                                 ("adept_ext", "fused")):
            if f"extra_peak_mb_{suffix}" in r:
                out += [row(provider, "time", r[f"{suffix}_s"] * 1e3, "ms", **fields),
                        row(provider, "peak_extra_memory", r[f"extra_peak_mb_{suffix}"], "MB", **fields)]
        out += [row("adept_ext", metric, r[key], "x", **fields) for metric, key in
                (("speedup_vs_eoupct_style", "speedup_vs_eoupct_style"),
                 ("speedup_vs_torch_cached", "speedup_vs_torch_cached")) if key in r]
        out += [row("adept_ext", "bandwidth", r["fused_gbps"], "GB/s", **fields),
                row("bandwidth_probe", "bandwidth", r["bandwidth_probe_gbps"], "GB/s", **fields),
                row("adept_ext", "bandwidth_fraction", r["bandwidth_fraction"], "", **fields)]
        if "nominal_bandwidth_fraction" in r:
            out.append(row("adept_ext", "nominal_bandwidth_fraction", r["nominal_bandwidth_fraction"], "", **fields))
    fixed = results["fixed_cost"]
    fields = {"dtype": "float32", "shape": f"{fixed['tensors']} one-element tensors, k {fixed['k']}"}
    out += [row(provider, "time_per_call", fixed[key] * 1e6, "µs", **fields)
            for provider, key in (("torch_cached", "torch_cached_s"), ("adept_ext", "fused_s"))]
    return out
