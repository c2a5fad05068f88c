"""The options every runner takes (one domain or a task sequence), and their checks."""
import math
import os
import types
import typing
from dataclasses import dataclass, fields
from typing import Dict

import torch

from .. import parallel
from ..errors import RunError
from ..lm_loss import LOSS_IMPLEMENTATIONS
from ..methods import create
from ..models import check_attention
from .tracking import backends_of

FROZEN_DTYPES = ("auto", "bfloat16", "float32")


@dataclass
class TrainOptions:
    """Options of every runner (one domain or a task sequence), with their defaults."""

    model: str = "smollm2-135m"       # local HF checkpoint directory or an embedded model name
    out: str = "runs/run"             # output directory
    method: str = "adept"             # a registered method (adept_ext.methods)
    k: int = 4                        # layers to expand / train (adept, llama_pro, adept_no_expand, *_seq per task)
    block_len: int = 128              # tokens per block
    batch_size: int = 4               # blocks per micro-batch
    grad_accum: int = 1               # micro-batches per optimizer step
    steps: int = 40                   # optimizer steps (per task in a sequence)
    lr: float = 3e-4                  # base learning rate
    warmup_steps: int = 4             # linear warmup, then cosine decay to 0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0        # gradient clipping (0 = off)
    logging_steps: int = 1            # read the training loss every N steps and log their mean (HF's name)
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward (HF's, non-reentrant)
    attn_implementation: str = "sdpa"  # transformers' attention backend: sdpa | eager | flash_attention_2
    loss_implementation: str = "auto"  # next-token loss: auto (fused on a plain linear head) | fused | hf
    compile: bool = False             # torch.compile each decoder layer for the training steps
    mix_general: float = 0.0          # share of the training blocks (each task's) drawn from the general corpus
    probe_blocks: int = 8             # general blocks used to probe layers and score units
    eval_blocks: int = 16             # held-out blocks per corpus for evaluation
    save_every: int = 20              # checkpoint every N steps (0 = never)
    recompute_every: int = 20         # ADEPT: recompute unit importance every N steps
    normalize: str = "rank"           # ADEPT: unit-importance normalisation (rank, per_kind, global)
    lora_rank: int = 8
    seed: int = 0
    bf16: str = "auto"                # auto (GPU with bf16 support) | on | off
    frozen_dtype: str = "auto"        # weights that don't train: auto (bf16 under bf16 autocast) | bfloat16 | float32
    device: str = "auto"              # auto | cpu | cuda
    parallel: str = "ddp"             # under torchrun: ddp | fsdp2 (parameters and optimizer state sharded)
    resume: bool = False              # continue the run in `out` from its last checkpoint
    overwrite: bool = False           # replace an existing run in `out`
    data_workers: int = 0             # processes tokenising a file/folder corpus (0 = the CPU count, at most 8)
    report_to: str = "none"           # live tracking: none | comma-separated tensorboard, mlflow, wandb, trackio


def options_from(cls, overrides: Dict, sequence: bool = False):
    """`cls` (a TrainOptions subclass) from a dict of options, with every value checked; the
    method is created once here so that its own options are checked too. RunError on bad input."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RunError(f"unknown option(s): {', '.join(unknown)}")
    check_types(cls, overrides)
    cfg = cls(**overrides)
    for name in ("block_len", "batch_size", "grad_accum", "steps", "logging_steps", "probe_blocks", "eval_blocks",
                 "recompute_every", "k"):
        if getattr(cfg, name) < 1:
            raise RunError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "save_every", "weight_decay", "max_grad_norm"):
        if not getattr(cfg, name) >= 0:
            raise RunError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise RunError(f"lr must be a finite number > 0, got {cfg.lr}")
    if cfg.block_len < 2:
        raise RunError(f"block_len must be >= 2 (a block needs a next token to score), got {cfg.block_len}")
    if not 0 <= cfg.mix_general < 1:
        raise RunError(f"mix_general must be in [0, 1), got {cfg.mix_general}")
    if cfg.loss_implementation not in LOSS_IMPLEMENTATIONS:
        raise RunError(f"loss_implementation must be one of {', '.join(LOSS_IMPLEMENTATIONS)}, "
                       f"got {cfg.loss_implementation!r}")
    if cfg.data_workers < 0:
        raise RunError(f"data_workers must be >= 0 (0 = the CPU count), got {cfg.data_workers}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise RunError(f"device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.bf16 not in ("auto", "on", "off"):
        raise RunError(f"bf16 must be auto, on or off, got {cfg.bf16!r}")
    if cfg.frozen_dtype not in FROZEN_DTYPES:
        raise RunError(f"frozen_dtype must be one of {', '.join(FROZEN_DTYPES)}, got {cfg.frozen_dtype!r}")
    if cfg.frozen_dtype == "bfloat16" and cfg.parallel == "fsdp2":
        raise RunError("--frozen-dtype bfloat16 with --parallel fsdp2 is not supported (FSDP2 all-gathers each layer's "
                       "parameters in one dtype); use --frozen-dtype auto or float32 with fsdp2")
    if cfg.parallel not in parallel.ENGINES:
        raise RunError(f"parallel must be one of {', '.join(parallel.ENGINES)}, got {cfg.parallel!r}")
    if cfg.parallel == "fsdp2" and parallel.launched_world() < 2:
        raise RunError("--parallel fsdp2 shards the model over the processes of torchrun: launch with "
                       "`torchrun --nproc-per-node N` (N >= 2), or leave --parallel at ddp for one process")
    if cfg.compile and cfg.parallel == "fsdp2":
        raise RunError("--compile with --parallel fsdp2 is not supported yet (FSDP2's all-gather hooks would be "
                       "traced inside each compiled layer); use --compile with ddp, or fsdp2 without --compile")
    backends_of(cfg.report_to)  # an unknown or missing backend: an error before anything trains
    check_attention(cfg.attn_implementation, "cpu" if cfg.device == "cpu" or not torch.cuda.is_available() else "cuda")
    method = create(cfg.method, cfg, sequence=sequence)  # MethodError (a RunError) for the method's own options
    if cfg.parallel == "fsdp2" and not method.shardable:
        raise RunError(f"method {cfg.method} cannot train a model sharded by FSDP2 (its hooks need the whole "
                       "weights); use --parallel ddp")
    return cfg


def check_types(cls, overrides: Dict):
    """RunError for a value of the wrong type (a TOML `lr = "1e-4"`, `steps = 2.5`): an int is
    accepted for a float option, a bool is never a number."""
    hints = typing.get_type_hints(cls)
    for name, value in overrides.items():
        want = hints[name]
        allowed = typing.get_args(want) if typing.get_origin(want) in (typing.Union, types.UnionType) else (want,)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not any(value is None if a is type(None) else
                   (numeric and a in (int, float) and (a is float or isinstance(value, int)))
                   or (a not in (int, float) and isinstance(value, a)) for a in allowed):
            names = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
            raise RunError(f"{name} must be of type {names}, got {value!r} ({type(value).__name__})")


def data_workers(cfg) -> int:
    """Processes that tokenise a file, folder or saved-dataset corpus: `data_workers`, or for 0 the
    CPU count (at most 8)."""
    return cfg.data_workers or min(8, os.cpu_count() or 1)
