"""The training loop's micro-batches through a `torch.utils.data.DataLoader`: which batches a rank
reads from a step on (the order a resumed run continues), read ahead by `--dataloader-num-workers`
worker processes and, on a GPU, pinned by the loader (`loop.batch_to_device` then pins nothing again)."""
import os
import sys

import torch
from torch.utils.data import DataLoader, Sampler

from ..data import StreamBatches


def micro_batch_order(step: int, cfg, world: int, rank: int) -> range:
    """The batch indices rank `rank` of `world` trains on from step `step` up to `cfg.steps`:
    micro-batch m of step s is batch (s·A + m)·W + r (A = `cfg.grad_accum`), so the ranks take
    disjoint, interleaved batches (r, r + W, …) and a run resumed at step s reads what an
    uninterrupted one reads from there. Indices grow without end; the batches are cycled."""
    per_step = cfg.grad_accum * world
    return range(step * per_step + rank, cfg.steps * per_step, world)


class Cycled(Sampler):
    """The indices of `order` modulo `n`: a sequence of n batches read over and over."""

    def __init__(self, order: range, n: int):
        self.order, self.n = order, n

    def __iter__(self):
        return (i % self.n for i in self.order)

    def __len__(self) -> int:
        return len(self.order)


def batch_loader(batches, cfg, step: int, device: torch.device, world: int, rank: int) -> DataLoader:
    """A DataLoader of the micro-batches `micro_batch_order` names, in that order: from a sequence
    of host batches (`batches[i]`, cycled by `Cycled`) or a `data.StreamBatches` (read forward).
    `cfg.dataloader_num_workers` processes build them ahead (each worker gets a copy of `batches`
    and builds whole batches, so the batches do not depend on the count; a stream is read by one
    process, `train.config_from` refuses more); on a GPU they come pinned, for an asynchronous copy."""
    order, workers = micro_batch_order(step, cfg, world, rank), cfg.dataloader_num_workers
    if workers:  # forked workers must not share the parent's tokenizer thread pool (tokenizers' own advice)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if isinstance(batches, StreamBatches):
        dataset, sampler = batches.reading(order), None
    else:
        dataset, sampler = batches, Cycled(order, len(batches))
    # forked workers (torch's default on Linux before Python 3.14) share a memory-mapped corpus: a
    # worker started by spawn or forkserver would receive a pickled copy of all of it
    context = "fork" if workers and sys.platform == "linux" else None
    return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == "cuda", multiprocessing_context=context,
                      generator=torch.Generator())  # its seed draw leaves the run's random numbers as they were
