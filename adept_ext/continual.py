"""The task-sequence runner (docs/methods.md §5): a model learns task 1, then task 2, … with one method from
the registry, and is scored on every task and on held-out general text after each.

Scores: a[t][i] is the score on task i after training through task t (row 0: the base model);
score = accuracy for instruction tasks and −loss for text tasks. With T tasks,
AA = (1/T) Σ_i a[T][i], BWT = (1/(T−1)) Σ_{i<T} (a[T][i] − a[i][i]) (negative = forgetting),
FWT = (1/(T−1)) Σ_{i≥2} (a[i−1][i] − a[0][i]) (GEM's definition with the base model as the
reference), general forgetting = general loss after task T − general loss of the base model.

`run(ContinualConfig(...))` writes report.json, report.md, matrix.png (a[t][i]), general.png
(general loss across tasks), one folder per task with what its method computed, and the final
model (a plain Hugging Face checkpoint). A kill between or inside tasks resumes (`resume`) to
the same result: a checkpoint after every task (with the model as it was then) and every
`save_every` steps inside one.
"""
import gc
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Collection, Dict

import torch

from . import data, merge_back, parallel
from .errors import InputError, RunError
from .methods import create
from .methods.base import REGISTRY, option
from .lm_loss import loss_path
from .models.packed_attention import check_packing
from .models import load_model, place_model
from .data.truncation import report_entries
from .training.sequence import (Evaluator, add_benchmarks, build_report, save_exact, track_scores,
                                write_report)
from .training.markdown import signed
from .training.options import TOOLS
from .training import (CHECKPOINT, BenchmarkOptions, MergeBackOptions, TaskHooks, Tracker, TrainOptions, atomic_dir,
                       atomic_write, check_memory, check_merge_back, check_out, device_for, fit_task, frozen_dtype_for,
                       merge_back_alpha, options_from, peak_memory_mb, prepare_out, read_checkpoint,
                       remove_stale_shards, rng_state, set_rng_state, use_bf16, with_method_options)

logger = logging.getLogger(__name__)
RESUME_MODEL = ".resume-model"  # the model after the last finished task, while the sequence runs


@dataclass
class ContinualOptions(MergeBackOptions, BenchmarkOptions, TrainOptions):
    """The options of a task-sequence run that are the runner's own (defaults: the built-in sequence on
    the embedded model, about 8 minutes on 2 CPU cores); `ContinualConfig` adds the sequence
    methods' options."""

    out: str = option("runs/continual", commands=TOOLS, affects_results=False, known_as=("output_dir",),
                      help="output directory")
    method: str = option("seq_lora", help="adaptation method")
    tasks: str = option("builtin", help=(
        "comma-separated tasks in order, each SOURCE or NAME=SOURCE: text files/folders, JSONL with 'text' (text "
        "task) or with 'prompt'/'completion' or 'prompt'/'answer' (instruction task), python-docs, python-source, "
        "bbc-topic, sms-spam, rt-sentiment, parl-language, trec-loc, trec-num, trec-enty, trec-desc; or "
        "builtin (python-docs, python-source, bbc-topic), classification (bbc-topic, sms-spam, rt-sentiment, "
        "parl-language) or questions (trec-loc, trec-num, trec-enty, trec-desc: related tasks)"))
    general: str = option("bbc-news", help=(
        "general-domain corpus, held out from every task: text file, folder, JSONL with 'text', or bbc-news / "
        "python-docs"))
    eval_blocks: int = option(16, commands=("eval", "diagnose"),
                              help="held-out blocks (text) or examples (instruction) per task")
    benchmarks_every: int = option(1, help=(
        "with --benchmarks: score the base model, the model after every Nth task and after the last (lm-eval's "
        "tasks can cost more than a task's training); 0: the base model and the last only"))


def continual_config_class() -> type:
    """Every option of a task-sequence run: the runner's (`ContinualOptions`) and the sequence methods'."""
    return with_method_options(ContinualOptions, sequence=True)


ContinualConfig = continual_config_class()  # the built-in methods'; a method registered later: continual_config_class()


def config_from(overrides: Dict, given: Collection[str] = ()) -> ContinualConfig:
    """A checked ContinualConfig (RunError on bad input); `given`: the options the user gave (an
    option of another method among them is refused)."""
    cfg = options_from(continual_config_class(), overrides, sequence=True, given=given)
    check_merge_back(cfg, auto=False)
    if cfg.merge_back and not REGISTRY[cfg.method].dense_result:
        raise RunError(f"--merge-back moves the model after a task toward the one before it; {cfg.method} does not "
                       "end a task with one dense model of what it learned (it keeps or merges its adapters itself)")
    if cfg.benchmarks_every < 0:
        raise RunError(f"benchmarks_every must be >= 0 (0: the base model and the last only), "
                       f"got {cfg.benchmarks_every}")
    return cfg


def run(cfg: ContinualConfig, progress: bool = True, log=logger.info) -> Dict:
    """Learn `cfg.tasks` in order with `cfg.method`; returns the report (also written to `cfg.out`).
    Under torchrun the ranks train with DistributedDataParallel (or FSDP2 under `parallel="fsdp2"`)
    and rank 0 writes (see `parallel`). Under FSDP2 each task is prepared on the whole model,
    sharded for its training only, and unsharded again (`parallel.unshard_model`) before
    `end_task`, evaluation and saving."""
    device = device_for(cfg)
    return parallel.run_on_ranks(device, lambda progress_, log_: _run(cfg, device, progress_, log_), progress, log)


def _run(cfg: ContinualConfig, device, progress, log) -> Dict:
    started = time.time()
    main = parallel.is_main()
    bf16 = use_bf16(cfg, device)
    frozen = frozen_dtype_for(cfg, bf16)  # refused before anything loads
    hold = frozen if frozen != torch.float32 else None  # held from the load on (docs/design.md, "Precision")
    to_host = hold is not None or cfg.frozen_dtype == "nf4"  # each task merges on the host, then held again
    out = check_out(cfg, "continual")
    method = create(cfg.method, cfg, sequence=True)
    checkpoint = read_checkpoint(out) if cfg.resume else None
    if checkpoint and cfg.drift_tokens and checkpoint.get("drift_reference") is None:
        raise RunError(f"the checkpoint in {out} was written before the drift signal existed (it holds no base "
                       "distributions): resume it with --drift-tokens 0")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        model, tokenizer = load_model(cfg.model, device=device, attn_implementation=cfg.attn_implementation, hold=hold)
        method.check(model)
        if cfg.packing:
            check_packing(model, cfg.batch_size, torch.bfloat16 if bf16 else None)  # as the steps run
        loss = loss_path(model, cfg.loss_implementation)
        sequence = data.TaskSequence(cfg, tokenizer)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    tasks = sequence.tasks
    check_memory(cfg, model, bf16)
    examples = report_entries(sequence.sources, log)  # report.json's "data"
    log(f"loss: {loss}")
    out = prepare_out(cfg, "continual") if main else out
    parallel.barrier(device)
    evaluator = Evaluator(cfg, tasks, sequence.general_eval, device, tokenizer.eos_token_id, progress, method)

    if checkpoint and checkpoint["completed"] > 0:  # the base model freed first: the load checks the free memory
        model = None
        gc.collect()
        model = load_model(out / RESUME_MODEL, device=device, attn_implementation=cfg.attn_implementation,
                           hold=hold)[0]
    evaluator.drift_reference = checkpoint.get("drift_reference") if checkpoint else None
    rows = checkpoint["rows"] if checkpoint else [evaluator.row(model, "base", base=True)]
    if not checkpoint:
        add_benchmarks(rows[0], cfg, model, tokenizer, out / "benchmark_samples_base.jsonl", log)
    per_task = checkpoint["per_task"] if checkpoint else []
    history = checkpoint["history"] if checkpoint else []
    first = checkpoint["completed"] if checkpoint else 0
    inside = checkpoint is not None and "step" in checkpoint  # killed inside task `first`
    if checkpoint:  # inside a task: the state the task started with (prepare may need it)
        method.load_state_dict(checkpoint["task_start" if inside else "method"])
    if checkpoint and not inside:
        set_rng_state(checkpoint["rng"])
    log(f"{cfg.method} on {len(tasks)} tasks: {', '.join(f'{t.name} ({t.kind})' for t in tasks)}; "
        f"base general loss {rows[0]['general_loss']:.4f}")

    tracker = Tracker(cfg.report_to, out, asdict(cfg), cfg.method)
    try:
        if not checkpoint:
            track_scores(tracker, tasks, rows, 0)
        for t in range(first, len(tasks)):
            task, t0 = tasks[t], time.time()
            task_dir = out / f"task-{t + 1}-{task.name}" if main else None  # what rank 0 writes for this task
            hooks = _TaskHooks(task_dir, t, len(tasks), task.name, log, cfg)
            hooks.fields = {"completed": t, "rows": rows, "per_task": per_task, "history": history,
                            "task_start": method.state_dict(), "drift_reference": evaluator.drift_reference}
            resuming = inside and t == first
            task_history = checkpoint["task_history"] if resuming else {"train": []}
            hooks.first_step = checkpoint["step"] if resuming else 0
            extras = {}
            fit = fit_task(model, method, cfg, device, bf16,
                           lambda prepared, t=t: sequence.train_batches(t, method.train_blocks), task_history,
                           out=out, desc=f"task {t + 1}/{len(tasks)} {task.name} ({cfg.method})",
                           general_probe=sequence.general_probe, domain_probe=sequence.domain_probe(t), task_index=t,
                           checkpoint=checkpoint if resuming else None, hooks=hooks, artifacts=task_dir, report=extras,
                           tracker=tracker, step_offset=t * cfg.steps, progress=progress, to_host=to_host, log=log)
            model = fit["model"]
            if cfg.merge_back:  # toward the model the task started from (the previous task's)
                merge_back.MergeBack(model, hooks.merge_start).set(merge_back_alpha(cfg), cfg.merge_back_schedule,
                                                                   cfg.merge_back_min)
                extras["merge_back"] = {"alpha": merge_back_alpha(cfg), "schedule": cfg.merge_back_schedule}
            if to_host:  # merged on the host, exact: on the device again, held, for the scores and the next task
                place_model(model, device, torch.float32, hold)
            for p in model.parameters():
                p.requires_grad_(False)
            rows.append(evaluator.row(model, f"after {task.name}"))
            if t + 1 == len(tasks) or cfg.benchmarks_every and (t + 1) % cfg.benchmarks_every == 0:
                add_benchmarks(rows[-1], cfg, model, tokenizer, (task_dir or out) / "benchmark_samples.jsonl", log)
            per_task.append({"task": task.name, "kind": task.kind, "layers": fit["task"].layers,
                             "summary": fit["task"].summary, "trainable_parameters": fit["trainable"],
                             "seconds": round(time.time() - t0, 1), "peak_memory_mb": round(peak_memory_mb(device)),
                             "tokens_per_second": hooks.tokens_per_second,
                             "memory_estimate_mb": fit["memory_estimate_mb"]["total"], **extras})
            track_scores(tracker, tasks, rows, (t + 1) * cfg.steps)
            history.append(task_history["train"])
            log(f"after {task.name}: scores {[round(s, 4) for s in rows[-1]['scores']]}, "
                f"general loss {rows[-1]['general_loss']:.4f}")
            if t + 1 < len(tasks) and main:
                atomic_dir(out / RESUME_MODEL, lambda tmp: save_exact(model, tokenizer, tmp))
                state = {"completed": t + 1, "rows": rows, "per_task": per_task, "history": history,
                         "method": method.state_dict(), "rng": rng_state(), "world_size": parallel.world_size(),
                         "drift_reference": evaluator.drift_reference}
                atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))
                remove_stale_shards(out)
    finally:
        tracker.close()

    report = build_report(cfg, tasks, rows, per_task, history, device, bf16, time.time() - started, loss)
    report["data"] = examples
    if main:
        atomic_dir(out / "model", lambda tmp: save_exact(model, tokenizer, tmp))
        write_report(report, out)
        (out / CHECKPOINT).unlink(missing_ok=True)
        shutil.rmtree(out / RESUME_MODEL, ignore_errors=True)
        remove_stale_shards(out)
    m = report["metrics"]
    log(f"AA {m['AA']:.4f}, BWT {signed(m['BWT'])}, FWT {signed(m['FWT'])}, general forgetting "
        f"{report['general_forgetting']:+.4f}; report: {out / 'report.md'}")
    parallel.barrier(device)  # every rank returns once rank 0 has written the run
    return report


class _TaskHooks(TaskHooks):
    """The sequence's part of a task: its folder, the log line, the sequence so far in checkpoints,
    the task's training throughput."""

    def __init__(self, task_dir, t, n_tasks, name, log, cfg):
        self.task_dir, self.t, self.n_tasks, self.name, self.log, self.cfg = task_dir, t, n_tasks, name, log, cfg
        self.fields, self.first_step, self.tokens_per_second = {}, 0, None

    def trained(self, step):
        seconds = time.time() - self.started
        tokens = (step - self.first_step) * self.cfg.grad_accum * self.cfg.batch_size * self.cfg.max_length
        self.tokens_per_second = round(tokens / seconds, 1) if seconds else None

    def prepared(self, task, n_trainable):
        self.started = time.time()
        if self.cfg.merge_back:  # θ₀: the model the task starts from (a resumed task is prepared anew from it)
            self.merge_start = merge_back.start_weights(task.model)
        if self.task_dir is not None:
            self.task_dir.mkdir(exist_ok=True)
            task.method.write_artifacts(self.task_dir)
        self.log(f"task {self.t + 1}/{self.n_tasks} {self.name}: {task.summary}; trainable {n_trainable / 1e6:.2f}M")

    def checkpoint_fields(self):
        return self.fields
