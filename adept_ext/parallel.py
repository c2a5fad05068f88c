"""Data parallelism for the runners through PyTorch's own engines: `torchrun` starts the processes
and sets RANK / WORLD_SIZE / LOCAL_RANK; `init_from_env` joins them into a process group (NCCL on
GPUs, gloo on the CPU) and `wrap` puts the trained model into DistributedDataParallel.

Conventions of the runners under data parallelism: every rank loads the same model and data and
seeds the same way; rank r takes micro-batches r, r + W, r + 2W, … of the sequence a single
process would take (so W ranks with grad_accum g equal one process with grad_accum g·W); probes
and unit importance shard their batches and all-reduce (adept/probe.py, adept/units.py); evaluation runs on
every rank (identical results; under FSDP2 with the same all-gathers on every rank); rank 0 alone
writes files and logs.

Two engines (`ENGINES`): `ddp` (DistributedDataParallel: every rank holds the whole model and its
optimizer state) and `fsdp2` (`torch.distributed.fsdp.fully_shard` per decoder layer, then the
root: parameters, gradients and AdamW state are sharded, for models whose optimizer state does not
fit one device). Checkpoints of sharded runs go through `torch.distributed.checkpoint` (DCP) as
safetensors files, with no pickle.
The runners shard a model only to train it: before `end_task` (merging, evaluation, saving, the
next task's expansion) `unshard_model` makes it whole and plain again on every rank.
"""
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .ops.torch_internals import undo_fully_shard


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def launched_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device(device_type: str) -> torch.device:
    """This process's device: cuda:LOCAL_RANK on GPUs (never a bare "cuda"), else the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device_type)


def init_from_env(device: torch.device) -> bool:
    """Join torchrun's process group when launched with WORLD_SIZE > 1 and none exists yet;
    returns whether this call created it (and so must destroy it)."""
    if launched_world() <= 1 or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


@contextmanager
def process_group(device: torch.device):
    """Inside: the torchrun process group joined (when launched with WORLD_SIZE > 1); left on exit
    if this context created it."""
    created = init_from_env(device)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def quiet(*args, **kwargs):
    """A `log` that says nothing (ranks other than 0)."""


def run_on_ranks(device: torch.device, body, progress: bool, log):
    """`body(progress, log)` inside the process group, with progress bars and the log on rank 0 only."""
    with process_group(device):
        main = is_main()
        return body(progress and main, log if main else quiet)


ENGINES = ("ddp", "fsdp2")


def wrap(model, device: torch.device):
    """The model to train: DistributedDataParallel over all ranks when there are several."""
    if world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def fully_shard_model(model, layers, bf16: bool) -> Callable[[torch.nn.Parameter], torch.nn.Parameter]:
    """FSDP2: `fully_shard` every module of `layers` (the decoder layers), then `model` itself, over
    all ranks (bf16 parameters and fp32 gradient reduction under `bf16`, else the parameters' own
    dtype). The parameters are replaced by sharded ones (DTensors); returns the map from an old
    parameter to its sharded replacement (optimizer groups built before sharding need it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = {id(p): n for n, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    sharded = dict(model.named_parameters())
    return lambda p: sharded[names[id(p)]]


def is_sharded(model) -> bool:
    """Whether `model` (or a module inside it) was sharded by FSDP2's `fully_shard`."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def unshard_model(model):
    """Undo `fully_shard_model` in place (a collective every rank calls; nothing for an unsharded
    model): every parameter becomes a whole plain parameter again on every rank (tied ones stay
    tied) and the hooks, state and classes `fully_shard` added are removed, so the model is the
    plain module it was (to merge, expand, evaluate and save, or to shard again). FSDP2 has no
    public inverse of `fully_shard`: `torch_internals.undo_fully_shard` takes back what it adds."""
    return undo_fully_shard(model)


def _split_state(state: dict, prefix: str = ""):
    """(tensors, values) of a nested state dict: its tensors, flat under '/'-joined key paths, and
    the same tree of dicts with every tensor left out (the optimizer's param_groups: numbers,
    strings, lists)."""
    tensors, values = {}, {}
    for key, value in state.items():
        if isinstance(value, dict):
            inner, values[key] = _split_state(value, f"{prefix}{key}/")
            tensors.update(inner)
        elif isinstance(value, torch.Tensor):
            tensors[f"{prefix}{key}"] = value
        else:
            values[key] = value
    return tensors, values


def _put_values(state: dict, values: dict):
    """Put the non-tensor `values` of `_split_state` back into `state` (in place)."""
    for key, value in values.items():
        if isinstance(value, dict):
            _put_values(state[key], value)
        else:
            state[key] = value


def save_sharded(path: Path, model, optimizer) -> dict:
    """Every rank writes its shards of `model`'s and `optimizer`'s tensors into the new directory
    `path` as safetensors files (`torch.distributed.checkpoint` with its Hugging Face storage: the
    chunk offsets in each file's JSON header, no pickled `.metadata`); a collective every rank calls
    with the same path. Returns the state's other values (the optimizer's param_groups, the same
    on every rank), which the caller keeps in its own checkpoint file and gives to `load_sharded`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if is_main():
        shutil.rmtree(path, ignore_errors=True)  # a half-written directory of a killed save
    barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors, values = _split_state({"model": model_state, "optimizer": optimizer_state})
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))
    barrier()
    return values


def load_sharded(path: Path, model, optimizer, values: dict):
    """Load what `save_sharded` wrote into `path` (and returned as `values`) into `model` and
    `optimizer` (the same world size). Nothing is unpickled: DCP's safetensors reader takes the
    shapes and offsets from the files' JSON headers, and `values` are plain data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    tensors, _ = _split_state(state)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)))  # into `state`'s tensors, in place
    _put_values(state, values)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of a per-rank float over all ranks (the value itself in one process)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world_size()


def sum_over_ranks_(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over all ranks, in place, without reading it on the host (itself in one process)."""
    if world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def barrier(device: Optional[torch.device] = None):
    if world_size() > 1:
        dist.barrier(device_ids=[device.index] if device is not None and device.type == "cuda" else None)


@contextmanager
def rank_zero_first(device: Optional[torch.device] = None):
    """Rank 0 runs the block first (e.g. building a cache), the other ranks after it (reading
    that cache); a plain block in one process."""
    if rank() != 0:
        barrier(device)
    try:
        yield
    finally:  # also when rank 0's block raises: the others then run it and meet the same error
        if rank() == 0:
            barrier(device)
