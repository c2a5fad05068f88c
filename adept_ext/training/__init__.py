"""The training engine both runners (`train`, `continual`) share: options and their checks (`options`), a
runner's config composed and read from their declarations (`config`), each runner's evaluation hooks,
scores and report (`one_domain`, `sequence`, `markdown`),
device, precision and memory, the loop (`fit_task` with its `TaskHooks`), checkpoints and
shards, run directories. It composes the mechanisms and `methods`; nothing below imports it."""
from .checkpoint import (SHARDS, load_training_state, read_checkpoint, remove_stale_shards, rng_state,
                         save_sharded_state, set_rng_state, shard, training_state)
from .device import check_memory, device_for, frozen_dtype_for, held_as_frozen, peak_memory_mb, use_bf16
from .loop import TaskHooks, evaluate, fit_task, optimizer_for, schedule, train_steps
from .config import check_types, result_options, typed_options, with_method_options
from .options import (BenchmarkOptions, MergeBackOptions, TrainOptions, as_recorded_today, check_benchmark_options,
                      check_merge_back, merge_back_alpha, options_from)
from .rundir import CHECKPOINT, atomic_dir, atomic_write, check_out, prepare_out, saved_options
from .tracking import Tracker, backends_of

__all__ = ["BenchmarkOptions", "CHECKPOINT", "MergeBackOptions", "SHARDS", "TaskHooks", "Tracker", "TrainOptions",
           "as_recorded_today", "atomic_dir", "atomic_write", "backends_of", "check_benchmark_options",
           "check_memory", "check_merge_back", "check_out", "check_types", "device_for", "evaluate",
           "fit_task", "frozen_dtype_for", "held_as_frozen", "load_training_state", "merge_back_alpha",
           "optimizer_for", "options_from", "peak_memory_mb", "prepare_out", "read_checkpoint",
           "remove_stale_shards", "result_options", "rng_state", "save_sharded_state", "saved_options", "schedule",
           "set_rng_state", "shard", "train_steps", "training_state", "typed_options", "use_bf16",
           "with_method_options"]
