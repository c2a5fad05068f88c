"""Checkpoints of a task in training: what continues it exactly (weights, optimizer, schedule,
the method's state, every RNG), written atomically; FSDP2 shards through
`torch.distributed.checkpoint` as safetensors (see `parallel`). Resuming loads data, never code:
checkpoint.pt with `weights_only=True`, shards only from the run's own `SHARDS-<step>` folder."""
import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Dict

import torch

from .. import parallel
from ..errors import InputError, RunError
from ..models import adapter
from .rundir import CHECKPOINT

SHARDS = "checkpoint-shards"  # sharded runs: the DCP directory of a checkpoint is SHARDS-<step>


def rng_state() -> Dict:
    """Every random generator the training draws from (Python, torch CPU, every GPU)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(model, method, optimizer, scheduler) -> Dict:
    """What a checkpoint needs to continue a task exactly: trainable weights, optimizer, schedule,
    the method's state and every RNG. A sharded (FSDP2) model's weights and optimizer state are
    not in it: every rank writes its shards with `save_sharded_state`."""
    state = {"scheduler": scheduler.state_dict(), "method": method.state_dict(), "rng": rng_state(),
             "world_size": parallel.world_size()}
    if not parallel.is_sharded(model):
        state.update(trainable={n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                     optimizer=optimizer.state_dict())
    return state


def read_checkpoint(out: Path) -> Dict:
    """The checkpoint of the run in `out`, for --resume. RunError when it was written by another
    number of processes: which micro-batches each rank takes, and a sharded run's shards, follow
    the world size, so resuming on another one would not continue the same run."""
    checkpoint = torch.load(out / CHECKPOINT, weights_only=True)
    world = parallel.world_size()
    saved = checkpoint.get("world_size", world)  # checkpoints from before the count was recorded: not checked
    if saved != world:
        raise RunError(f"--resume: the run in {out} was checkpointed by {saved} process(es) and this is {world}: "
                       f"resume it with the same number of processes ({saved})")
    if "shards" in checkpoint:
        shard_dir(out, checkpoint)  # refused here, before the model loads
    return checkpoint


def shard_dir(out: Path, checkpoint: Dict) -> Path:
    """The shard directory a sharded checkpoint names, checked: exactly `out/SHARDS-<step>` (any
    other name — an absolute path, `..` — could read outside the run), a directory that holds
    safetensors files only. InputError otherwise."""
    name, step = checkpoint["shards"], checkpoint.get("step")
    if not isinstance(step, int) or name != f"{SHARDS}-{step}":
        raise InputError(f"--resume: {out / CHECKPOINT} names the shard directory {name!r}; "
                         f"a checkpoint of step {step!r} has its shards in the run's own {SHARDS}-<step>")
    path = out / name
    if path.is_symlink() or not path.is_dir():
        raise InputError(f"--resume: {path} is not a directory of the run")
    others = sorted(p.name for p in path.iterdir() if p.suffix != ".safetensors" or p.is_symlink() or not p.is_file())
    if others:
        raise InputError(f"--resume: {path} holds {', '.join(others)}, not safetensors shards only (adept-ext "
                         "before its safetensors shards wrote pickled DCP files, which --resume does not load): "
                         "start the run again with --overwrite")
    return path


def save_sharded_state(out: Path, step: int, model, optimizer) -> Dict:
    """Sharded (FSDP2) runs: every rank writes its shards of the weights and optimizer state into
    `out/SHARDS-<step>` (a collective); returns the entries of the checkpoint that name it and hold
    the state's non-tensor values (empty for an unsharded model). The checkpoint file, written
    afterwards, is what makes it current."""
    if not parallel.is_sharded(model):
        return {}
    values = parallel.save_sharded(out / f"{SHARDS}-{step}", model, optimizer)
    return {"shards": f"{SHARDS}-{step}", "shard_values": values}


def remove_stale_shards(out: Path, keep: str = ""):
    """Delete the shard directories of `out` other than `keep` (rank 0, after the checkpoint naming `keep`)."""
    for path in out.glob(f"{SHARDS}-*"):
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)


def load_training_state(state: Dict, model, method, optimizer, scheduler, out: Path = None):
    """Restore what `training_state` saved (and, for a sharded model, its shards from `out`)."""
    if "shards" in state:
        parallel.load_sharded(shard_dir(out, state), model, optimizer, state["shard_values"])
    else:
        names = dict(model.named_parameters())
        for name, value in state["trainable"].items():
            names[name].data.copy_(value)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    method.load_state_dict(state["method"])
    set_rng_state(state["rng"])


def shard(model, setup, bf16: bool):
    """FSDP2: shard `model` (each decoder layer, then the root) and return `setup` with its
    trainable parameters and optimizer groups pointing at the sharded parameters."""
    new = parallel.fully_shard_model(model, adapter(model).layers, bf16)
    return replace(setup, trainable=[new(p) for p in setup.trainable],
                   groups=[{**g, "params": [new(p) for p in g["params"]]} for g in setup.groups])
