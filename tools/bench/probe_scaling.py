"""The exact probe on the same batches in 1 process and in W gloo processes (the threads split
evenly), as `torchrun` runs it: each rank probes batches[rank::W] and the sums are all-reduced."""
import multiprocessing as mp
import os
import sys
import time

import torch

from bench.common import row
from bench.probe import probe_setup


def _probe_rank(rank, world, port, n_blocks, threads, queue):
    """One process of the scaling run: gloo group of `world`, `threads` threads, the exact probe."""
    import torch.distributed as dist

    from adept_ext.adept.probe import layer_importance

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


def run(args, device):
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


def rows(results):
    world = results["processes"]
    fields = {"dtype": "float32", "shape": f"SmolLM2-135M, {results['blocks']} blocks x {results['block_len']} "
                                          f"tokens, batches of {results['batch_size']}, {results['cores']} cores"}
    return [row("1_process", "time", results["1_process_s"], "s", **fields),
            row(f"{world}_processes", "time", results[f"{world}_process_s"], "s", **fields),
            row(f"{world}_processes", "speedup", results["speedup"], "x", **fields),
            row(f"{world}_processes", "max_abs_diff_scores", results["max_abs_diff_scores"], "", **fields)]
