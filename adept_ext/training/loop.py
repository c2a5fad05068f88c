"""The training engine both runners share: evaluation, the optimizer and its schedule, the
step loop, and `fit_task`, which owns one task's whole block (prepare through `methods.prepare`,
memory check, shard or wrap, optimizer, resume, checkpoints, the steps, unshard, finish)."""
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, Optional

import torch
from tqdm.auto import tqdm

from .. import lm_loss, parallel
from ..models import adapter, base_model, held, quantize
from ..data import check_labels
from ..lm_loss import next_token_loss
from ..methods.task import Task, prepare
from ..ops.torch_internals import uncompile_module
from ..optim import make_optimizer
from .checkpoint import load_training_state, remove_stale_shards, save_sharded_state, shard, training_state
from .device import check_memory, export_held, frozen_dtype_for, hold_frozen, peak_memory_mb, release_held
from .loader import batch_loader
from .rundir import CHECKPOINT, atomic_write

logger = logging.getLogger(__name__)


def vocab_size(model) -> int:
    """Rows of the LM head of `model` (through DDP and PEFT wrappers): the labels' range."""
    return adapter(base_model(model)).lm_head.weight.shape[0]


def batch_to_device(batch: Dict[str, torch.Tensor], device: torch.device, vocab: int) -> Dict[str, torch.Tensor]:
    """A batch built on the host, its labels checked there (`data.check_labels`, InputError), on
    `device`: on a GPU copied from pinned memory (pinned here unless the training loader pinned
    it), so that the copy does not wait for the work queued before it. A batch already on a GPU
    (`evaluate` on a caller's own batches) is taken as it is."""
    if not batch["labels"].is_cpu:
        return batch
    check_labels(batch, vocab)
    if device.type == "cuda":
        return {k: (v if v.is_pinned() else v.pin_memory()).to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, batches, device, desc="eval", progress=True, loss_implementation: str = "auto") -> float:
    """Token-weighted mean next-token loss on `batches` (`lm_loss.next_token_loss`: fused on a
    plain linear head unless `loss_implementation` is "hf"); under bf16 autocast while the model
    holds bfloat16 weights (`held.autocast_for`: `run`'s evaluations, and one during a task)."""
    device = torch.device(device)
    vocab = vocab_size(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            n = int(lm_loss.labelled_tokens([batch]))  # on the host, before the batch moves
            batch = batch_to_device(batch, device, vocab)
            with held.autocast_for(model, device):
                total += float(next_token_loss(model, batch, loss_implementation)) * n
            count += n
    finally:
        model.train(was_training)
    return total / count


def schedule(cfg):
    """The lr factor of step s: linear warmup over `cfg.warmup_steps`, then cosine decay to 0 at `cfg.steps`."""
    def factor(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def optimizer_for(task: Task, cfg):
    """`cfg.optim` over the task's param groups (`optim.make_optimizer`: AdamW as `GroupedAdamW`, every
    group in one multi-tensor pass, so ADEPT's per-unit groups cost no extra launches; or bitsandbytes'
    8-bit AdamW, which reads every group's rate at each step too, the embedding weights' moments kept
    in float32 as Hugging Face's Trainer keeps them) with warmup + cosine, and the method's step hooks."""
    embeddings = [m.weight for m in task.model.modules() if isinstance(m, torch.nn.Embedding)]
    optimizer = make_optimizer(cfg.optim, task.param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               keep_float32=embeddings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg))
    task.attach(optimizer)
    return optimizer, scheduler


def activation_checkpointing(model, enable: bool):
    """Hugging Face's activation checkpointing of every decoder layer (non-reentrant), on or off;
    off also removes the input-embedding hook that turning it on adds."""
    if enable:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_disable()
        model.disable_input_require_grads()


def compile_layers(model, enable: bool):
    """`torch.compile` each decoder layer in place (`nn.Module.compile`: the module, its
    parameters and state-dict names stay as they are, so checkpoints, FSDP2 and saving see the
    same model), or undo it. One graph serves every layer of the same shape; hooks and PEFT
    layers inside a layer are traced with it."""
    for layer in adapter(model).layers:
        if enable:
            layer.compile()
        else:  # nn.Module.compile keeps the compiled callable here; None is the eager module again
            uncompile_module(layer)


class TaskHooks:
    """What a runner adds to `fit_task` (every hook optional)."""

    def prepared(self, task: Task, n_trainable: int):
        """After the method prepared the task (log, write what it computed)."""

    def after_step(self, step: int):
        """After each optimizer step, before a checkpoint (periodic evaluation)."""

    def checkpoint_fields(self) -> Dict:
        """The runner's own entries of an in-task checkpoint."""
        return {}

    def trained(self, step: int):
        """After the last step, on the model as trained (sharded under FSDP2; under fit_task's `to_host`
        its frozen weights still held), before finish."""

    def unsharded(self, step: int):
        """After `trained` and the unshard, on the whole model as trained (still held under `to_host`),
        before finish: what one rank may do alone (`run`'s benchmarks)."""


def step_items(micro_batches, world: int) -> torch.Tensor:
    """The divisor that makes a step's micro-batch losses sum to the mean over every labelled token
    of the step on every rank (Hugging Face's `num_items_in_batch`): the labelled tokens over all
    micro-batches and ranks, at least 1 (a step with none: loss 0, not NaN), / `world`, because the
    data-parallel engines average the ranks' gradients (and `mean_over_ranks` their losses). On the
    device: no host read."""
    count = parallel.sum_over_ranks_(lm_loss.labelled_tokens(micro_batches).to(torch.float32))
    return count.clamp_min(1) / world


def gradient_sync(model, sync: bool):
    """The context of one micro-batch's forward and backward: under data parallelism the ranks'
    gradients are reduced in its backward only when `sync` (the step's last micro-batch), and
    accumulated locally before (DDP's `no_sync`; FSDP2's `set_requires_gradient_sync`, which keeps
    the unsharded gradients until then): one gradient all-reduce (FSDP2: reduce-scatter) per
    optimizer step instead of one per micro-batch, the same sum of gradients."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return nullcontext() if sync else model.no_sync()
    if isinstance(model, FSDPModule):  # the root of `fully_shard_model`: sets every sharded layer
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def train_steps(model, task: Task, optimizer, scheduler, batches, cfg, device, bf16, history: Dict, step: int,
                desc: str, progress: bool, *, after_step, tracker=None, step_offset: int = 0) -> int:
    """AdamW steps from `step` up to `cfg.steps` over `batches` (a sequence of host batches, cycled,
    or a `data.StreamBatches`), `cfg.grad_accum` micro-batches per step and rank read through
    `loader.batch_loader` (its order: the same batches whatever the step a run resumed at and the
    number of loader workers, which stop when the steps end or fail) and `batch_to_device`; bf16
    autocast when `bf16`, gradient clipping; the loss from `task.loss`; calls `after_step(step)`
    after each step. Returns the step.
    A micro-batch's loss is its share of the step's mean over every labelled token of the step's
    micro-batches on every rank (`step_items`), so uneven counts (instruction data) weigh each
    token alike and a micro-batch without one adds 0.

    The loss stays on the device, summed over micro-batches and steps, and is read (the steps' one
    host synchronisation; under torchrun a second, the mean over ranks) every `cfg.logging_steps`
    steps and at the last: the mean over the steps since the last read (and over ranks) is
    appended to `history["train"]` with the step's lr, shown on the progress bar with the tokens/s
    since the last read, and sent to `tracker` (at step `step_offset + step`) with the step's grad
    norm, peak memory and the method's own metrics. Under data parallelism `model` is the
    DDP-wrapped model (or the FSDP2-sharded one) and rank r takes micro-batches r, r + W, …
    (`loader.micro_batch_order`); the ranks' gradients are reduced once per step, in the last
    micro-batch's backward (`gradient_sync`)."""
    world, rank, device = parallel.world_size(), parallel.rank(), torch.device(device)
    vocab, tracking = vocab_size(task.model), tracker is not None and tracker.active
    tokens_per_step = cfg.grad_accum * cfg.batch_size * cfg.max_length * world
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # float64: the sum a Python float would hold
    last_read = step
    loader = iter(batch_loader(batches, cfg, step, device, world, rank))  # workers start reading ahead
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, disable=not progress)
    try:
        while step < cfg.steps:
            if step == last_read:  # the time of the steps since the read, not the evaluation after it
                started = time.perf_counter()
            read = (step + 1) % cfg.logging_steps == 0 or step + 1 == cfg.steps
            optimizer.zero_grad(set_to_none=True)
            micro_batches = [batch_to_device(next(loader), device, vocab) for _ in range(cfg.grad_accum)]
            num_items = step_items(micro_batches, world)
            for i, batch in enumerate(micro_batches):
                with gradient_sync(model, i + 1 == len(micro_batches)):
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        loss = task.loss(batch, model, num_items=num_items, micro_batches=cfg.grad_accum)
                    loss.backward()
                loss_sum += loss.detach()
            grad_norm = None
            if cfg.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(task.trainable, cfg.max_grad_norm)
            elif tracking and read:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in task.trainable if p.grad is not None])
            note = task.step_note()
            if note:
                bar.set_postfix_str(f"{note} …")
            optimizer.step()
            scheduler.step()
            step += 1
            bar.update(1)
            if read:
                steps_read, last_read = step - last_read, step
                values = [loss_sum]
                if tracking:
                    values.append(getattr(grad_norm, "full_tensor", lambda: grad_norm)().double())  # FSDP2: a DTensor
                local_sum, *norm = torch.stack(values).tolist()  # the one host synchronisation
                loss_sum.zero_()
                loss_mean = parallel.mean_over_ranks(local_sum, device) / steps_read
                tokens_per_second = tokens_per_step * steps_read / (time.perf_counter() - started)
                lr = scheduler.get_last_lr()[0]
                history["train"].append({"step": step, "loss": loss_mean, "lr": lr})
                bar.set_postfix(loss=f"{loss_mean:.3f}", tokens_per_s=f"{tokens_per_second:.0f}")
                if tracking:
                    tracker.log({"train/loss": loss_mean, "train/lr": lr, "train/grad_norm": norm[0],
                                 "train/tokens_per_second": tokens_per_second,
                                 "train/peak_memory_mb": peak_memory_mb(device), **task.metrics()}, step_offset + step)
            after_step(step)
    finally:
        bar.close()
        del loader  # the last reference: its workers stop now, also when a step or `after_step` raised
    return step


def fit_task(model, method, cfg, device, bf16: bool, batches, history: Dict, *, out: Path, desc: str,
             general_probe, domain_probe=(), task_index: int = 0, diagnosis_batches=None,
             checkpoint: Optional[Dict] = None,
             hooks: TaskHooks = TaskHooks(), artifacts: Optional[Path] = None, report: Optional[Dict] = None,
             tracker=None, step_offset: int = 0, progress: bool = True, to_host: bool = False,
             log=logger.info) -> Dict:
    """One task, start to finish: `methods.prepare` (the layers of `checkpoint` when resuming
    inside the task), the memory check for what trains, shard (FSDP2) or wrap (DDP), the
    optimizer, the state of `checkpoint`, `cfg.steps` steps over `batches(task)` with the
    losses appended to `history["train"]` and sent to `tracker` from step `step_offset` (every
    `cfg.save_every` steps an in-task checkpoint into `out`, `history` in it as "task_history";
    Ctrl-C saves one too when it can), unshard, and `task.finish` (plots into `artifacts`,
    entries into `report`). The weights that do not train are held (`hold_frozen`; in 4 bits with
    --frozen-dtype nf4) through the steps; then put back exact on the device, or with `to_host`
    kept held for `hooks.trained` (the evaluation of the model as trained) and then made exact on
    the host for finish (`export_held`: merging and saving there, the device never holding them in
    float32). Returns {"model": the finished model, "task", "step", "trainable":
    the trainable parameter count, "memory_estimate_mb": the memory check's estimate for the steps,
    per part and in total}."""
    main = parallel.is_main()
    if method.trains_every_weight:  # nothing stays frozen to hold; OSF's SVD and eoupct's teacher read exact weights
        held.release(model)
    task = prepare(model, method, general_probe=general_probe, domain_probe=domain_probe, lr=cfg.lr,
                   weight_decay=cfg.weight_decay, total_steps=cfg.steps, seed=cfg.seed, task_index=task_index,
                   autocast_dtype=torch.bfloat16 if bf16 else None, diagnosis_batches=diagnosis_batches,
                   layers=checkpoint["layers"] if checkpoint else None,
                   loss_implementation=cfg.loss_implementation, progress=progress, log=log)
    held.release(model, trainable_only=True)  # what the load held and the method now trains: float32, exact
    n_trainable = sum(p.numel() for p in task.trainable)
    frozen = frozen_dtype_for(cfg, bf16)
    nf4 = cfg.frozen_dtype == "nf4"
    to_hold = quantize.frozen_linear_parameters(model) if nf4 else []
    try:  # from here on the weights are held: made exact whatever fails, the hold included, or the steps
        if hold_frozen(model, frozen, keep=to_hold) and frozen != torch.float32:  # nf4: held below, from float32
            log(f"{desc}: the weights that do not train are held in {str(frozen).removeprefix('torch.')}")
        shards = parallel.world_size() if cfg.parallel == "fsdp2" else 1
        if not nf4:  # nf4: once the layers are held, below
            estimate = check_memory(cfg, model, bf16, n_trainable, shards, method.extra_bytes(task.trainable))
        hooks.prepared(task, n_trainable)
        if cfg.gradient_checkpointing:  # after prepare: the copies an expansion added are checkpointed too
            activation_checkpointing(model, True)
        if cfg.compile:  # after checkpointing (it wraps the layers' calls) and before sharding, as torchtitan does
            compile_layers(model, True)
        if cfg.parallel == "fsdp2":  # options_from checked that torchrun started several processes
            task.setup = shard(model, task.setup, bf16)
            trained = model
        else:
            trained = parallel.wrap(model, device)
        optimizer, scheduler = optimizer_for(task, cfg)
        if nf4:  # after the optimizer's hooks (ADEPT scores its source layers there, before they are in 4 bits)
            n_4bit = quantize.hold_nf4(model, torch.bfloat16 if bf16 else torch.float32)
            log(f"{desc}: {n_4bit} frozen linear layers held in 4 bits (NF4), their exact weights on the host")
            # and before a checkpoint's optimizer state loads: the check counts that state, not yet allocated
            estimate = check_memory(cfg, model, bf16, n_trainable, shards, method.extra_bytes(task.trainable))
        step = 0
        if checkpoint:
            load_training_state(checkpoint, model, method, optimizer, scheduler, out)
            step = checkpoint["step"]
            log(f"resumed {desc} at step {step}")

        def save_checkpoint(done):
            shards = save_sharded_state(out, done, model, optimizer)  # FSDP2: a collective
            if not main:
                return
            state = {**hooks.checkpoint_fields(), "step": done, "layers": task.layers, "task_history": history,
                     **shards, **training_state(model, method, optimizer, scheduler)}
            atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))
            remove_stale_shards(out, shards.get("shards", ""))

        def after_step(done):
            nonlocal step
            step = done
            hooks.after_step(done)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                save_checkpoint(done)

        model.train()
        try:
            train_steps(trained, task, optimizer, scheduler, batches(task), cfg, device, bf16, history, step, desc,
                        progress, after_step=after_step, tracker=tracker, step_offset=step_offset)
        except KeyboardInterrupt:
            if parallel.is_sharded(model):  # saving is a collective the other ranks may never join
                log(f"interrupted in {desc} at step {step}: continue from the last checkpoint in {out} with --resume")
            else:
                save_checkpoint(step)
                log(f"interrupted in {desc} at step {step}: checkpoint saved in {out}; continue with --resume")
            raise
    except BaseException:  # no 4-bit layer is left behind: exact on the device (under to_host: the 4-bit
        if to_host:  # layers put back on the host, the rest left held, without a float32 copy on the device)
            quantize.release_nf4(model, "cpu")
        else:
            release_held(model)
        raise
    if not to_host:  # the exact weights again: evaluation, finish (merges, saving) and the next task see
        release_held(model)  # those the task started from, in float32
    if cfg.compile:  # evaluation and the next task run eager: no recompilation for no_grad or new adapters
        compile_layers(model, False)
    model.zero_grad(set_to_none=True)  # the last step's gradients: not kept through evaluation and the export
    hooks.trained(step)
    if cfg.gradient_checkpointing:
        activation_checkpointing(model, False)
    parallel.unshard_model(model)  # FSDP2: the whole weights on every rank again (a collective), for finish
    hooks.unsharded(step)
    if to_host:
        export_held(model)
    finished = task.finish(artifacts, report)
    return {"model": finished, "task": task, "step": step, "trainable": n_trainable,
            "memory_estimate_mb": {part: round(n / 2**20) for part, n in estimate.items()}}
