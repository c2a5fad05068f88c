"""The task-sequence runner (SPEC §5): a model learns task 1, then task 2, … with one method from
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
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from . import data, parallel
from .methods import Context, create
from .models import load_model
from .report import plot_matrix, plot_series
from .tasks import answer_scores, general_texts, load_tasks
from .rundir import CHECKPOINT, RunError, atomic_dir, atomic_write, check_out, prepare_out
from .train import (TrainOptions, _check_memory, _device, _peak_memory_mb, _rng_state, _set_rng_state, _use_bf16,
                    evaluate, load_training_state, optimizer_for, options_from, train_steps, training_state)

RESUME_MODEL = ".resume-model"  # the model after the last finished task, while the sequence runs


@dataclass
class ContinualConfig(TrainOptions):
    """Every option of a task-sequence run (defaults: the built-in sequence on the embedded model,
    about 8 minutes on 2 CPU cores)."""

    out: str = "runs/continual"
    method: str = "seq_lora"
    tasks: str = "builtin"            # comma-separated task sources in order, or builtin
    general: str = "bbc-news"         # general corpus, held out from every task
    k: int = 2                        # adept_seq / llama_pro_seq: copies per task
    steps: int = 40                   # optimizer steps per task
    warmup_steps: int = 4
    eval_blocks: int = 16             # held-out blocks (text) or examples (instruction) per task
    replay_fraction: float = 0.02     # replay: share of each earlier task's training blocks mixed in
    replay_base: str = "full"         # replay: on top of seq_full (full) or seq_lora (lora)
    o_lora_lambda: float = 0.5        # o_lora: weight of the orthogonality penalty
    # deal
    deal_rank: int = 8                # deal: LoRA rank
    deal_filter: str = "wavelet"      # deal: retention filter: wavelet (heat-kernel network) | haar (public code)
    deal_filter_on: str = "ab"        # deal: matrices filtered and updated: ab | a | b
    deal_scales: int = 3              # deal: heat-kernel scales of the wavelet filter
    deal_lambda1: float = 0.01        # deal: weight of ‖θ_retain‖_a^a
    deal_a: float = 10.0              # deal: exponent a (>= b)
    deal_lambda2: float = 0.001       # deal: weight of ‖θ_update‖_b^b
    deal_b: float = 2.0               # deal: exponent b


def config_from(overrides: Dict) -> ContinualConfig:
    """A checked ContinualConfig (RunError on bad input)."""
    cfg = options_from(ContinualConfig, overrides, sequence=True)
    if cfg.parallel == "fsdp2":  # every task changes the model (expansion, adapters) before it trains
        raise RunError("--parallel fsdp2 is available for adept-ext run; use --parallel ddp for continual")
    return cfg


def metrics(matrix: List[List[float]]) -> Dict[str, Optional[float]]:
    """AA, BWT and FWT of a score matrix [T+1][T] (row 0: the base model); BWT and FWT are None for T = 1."""
    T = len(matrix[0])
    aa = sum(matrix[T]) / T
    if T == 1:
        return {"AA": aa, "BWT": None, "FWT": None}
    bwt = sum(matrix[T][i] - matrix[i + 1][i] for i in range(T - 1)) / (T - 1)
    fwt = sum(matrix[i][i] - matrix[0][i] for i in range(1, T)) / (T - 1)
    return {"AA": aa, "BWT": bwt, "FWT": fwt}


class Evaluator:
    """Scores of a model on every task's held-out split and on the general corpus."""

    def __init__(self, cfg, tasks, general_eval, device, eos_id, progress, method):
        self.cfg, self.tasks, self.general_eval, self.device = cfg, tasks, general_eval, device
        self.eos_id, self.progress, self.method = eos_id, progress, method

    def row(self, model, label: str) -> Dict:
        """Task i is scored on the model `method.scoring(model, i)` yields; the general corpus on `model`."""
        scores, details = [], []
        for i, task in enumerate(self.tasks):
            held = data.first_blocks(task.held, self.cfg.eval_blocks)
            with self.method.scoring(model, i) as scored:
                if task.kind == "instruction":
                    result = answer_scores(scored, held, self.cfg.batch_size, self.device, self.eos_id)
                    scores.append(result["accuracy"])
                else:
                    result = {"loss": evaluate(scored, data.batches(held, self.cfg.batch_size), self.device,
                                               f"eval {task.name} ({label})", self.progress)}
                    scores.append(-result["loss"])
            details.append(result)
        general = evaluate(model, self.general_eval, self.device, f"eval general ({label})", self.progress)
        return {"label": label, "scores": scores, "details": details, "general_loss": general}


def run(cfg: ContinualConfig, progress: bool = True, log=print) -> Dict:
    """Learn `cfg.tasks` in order with `cfg.method`; returns the report (also written to `cfg.out`).
    Under torchrun the ranks train with DistributedDataParallel and rank 0 writes (see `parallel`)."""
    device = _device(cfg)
    return parallel.run_on_ranks(device, lambda progress_, log_: _run(cfg, device, progress_, log_), progress, log)


def _run(cfg: ContinualConfig, device, progress, log) -> Dict:
    started = time.time()
    main = parallel.is_main()
    bf16 = _use_bf16(cfg, device)
    out = check_out(cfg, "continual")
    method = create(cfg.method, cfg, sequence=True)
    checkpoint = torch.load(out / CHECKPOINT, weights_only=False) if cfg.resume else None
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        model, tokenizer = load_model(cfg.model, device=device)
        method.check(model)
        tasks = load_tasks(cfg.tasks, tokenizer, cfg.block_len, cfg.seed)
        general = data.token_blocks(general_texts(cfg.general), tokenizer, cfg.block_len)
        g_train, g_held = data.split_blocks(general, 0.1, cfg.seed)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from e
    _check_memory(cfg, model, bf16)
    out = prepare_out(cfg, "continual") if main else out
    parallel.barrier(device)
    general_probe = data.batches(data.first_blocks(g_train, cfg.probe_blocks), cfg.batch_size)
    evaluator = Evaluator(cfg, tasks, data.batches(data.first_blocks(g_held, cfg.eval_blocks), cfg.batch_size), device,
                          tokenizer.eos_token_id, progress, method)
    blocks = [t.train for t in tasks]

    if checkpoint and checkpoint["completed"] > 0:
        model = load_model(out / RESUME_MODEL, device=device)[0]
    rows = checkpoint["rows"] if checkpoint else [evaluator.row(model, "base")]
    per_task = checkpoint["per_task"] if checkpoint else []
    history = checkpoint["history"] if checkpoint else []
    first = checkpoint["completed"] if checkpoint else 0
    inside = checkpoint is not None and "trainable" in checkpoint  # killed inside task `first`
    if checkpoint:  # inside a task: the state the task started with (prepare may need it)
        method.load_state_dict(checkpoint["task_start" if inside else "method"])
    if checkpoint and not inside:
        _set_rng_state(checkpoint["rng"])
    log(f"{cfg.method} on {len(tasks)} tasks: {', '.join(f'{t.name} ({t.kind})' for t in tasks)}; "
        f"base general loss {rows[0]['general_loss']:.4f}")

    for t in range(first, len(tasks)):
        task, t0 = tasks[t], time.time()
        task_dir = out / f"task-{t + 1}-{task.name}" if main else None  # what rank 0 writes for this task
        domain_probe = data.batches(data.first_blocks(blocks[t], cfg.probe_blocks), cfg.batch_size)
        ctx = Context(general_probe, domain_probe, progress, torch.bfloat16 if bf16 else None, task_index=t, log=log)
        task_start = method.state_dict()
        setup = method.prepare(model, ctx, layers=checkpoint["layers"] if inside and t == first else None)
        if main:
            task_dir.mkdir(exist_ok=True)
            method.write_artifacts(task_dir)
        n_trainable = sum(p.numel() for p in setup.trainable)
        _check_memory(cfg, model, bf16, n_trainable)
        log(f"task {t + 1}/{len(tasks)} {task.name}: {setup.summary}; trainable {n_trainable / 1e6:.2f}M")
        trained = parallel.wrap(model, device)
        optimizer, scheduler = optimizer_for(method, setup, cfg)
        task_history = {"train": []}
        step = 0
        if inside and t == first:
            load_training_state(checkpoint, model, method, optimizer, scheduler)
            task_history, step = checkpoint["task_history"], checkpoint["step"]
            log(f"resumed task {task.name} at step {step}")

        def save_inside(done):
            if not main:
                return
            state = {"completed": t, "step": done, "layers": setup.layers, "rows": rows, "per_task": per_task,
                     "history": history, "task_history": task_history, "task_start": task_start,
                     **training_state(model, method, optimizer, scheduler)}
            atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))

        def after_step(done):
            nonlocal step
            step = done
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                save_inside(done)

        batches = data.batches(method.train_blocks(blocks, t), cfg.batch_size)
        model.train()
        try:
            train_steps(trained, method, setup, optimizer, scheduler, batches, cfg, device, bf16, task_history, step,
                        f"task {t + 1}/{len(tasks)} {task.name} ({cfg.method})", progress, after_step)
        except KeyboardInterrupt:
            save_inside(step)
            log(f"interrupted in task {task.name} at step {step}: checkpoint saved in {out}; continue with --resume")
            raise
        extras = {}
        model = method.end_task(model, task_dir, extras)
        for p in model.parameters():
            p.requires_grad_(False)
        rows.append(evaluator.row(model, f"after {task.name}"))
        per_task.append({"task": task.name, "kind": task.kind, "layers": setup.layers, "summary": setup.summary,
                         "trainable_parameters": n_trainable, "seconds": round(time.time() - t0, 1),
                         "peak_memory_mb": round(_peak_memory_mb(device)), **extras})
        history.append(task_history["train"])
        log(f"after {task.name}: scores {[round(s, 4) for s in rows[-1]['scores']]}, "
            f"general loss {rows[-1]['general_loss']:.4f}")
        if t + 1 < len(tasks) and main:
            atomic_dir(out / RESUME_MODEL, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
            state = {"completed": t + 1, "rows": rows, "per_task": per_task, "history": history,
                     "method": method.state_dict(), "rng": _rng_state()}
            atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    report = build_report(cfg, tasks, rows, per_task, history, device, bf16, time.time() - started)
    if main:
        atomic_dir(out / "model", lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        write_report(report, out)
        (out / CHECKPOINT).unlink(missing_ok=True)
        shutil.rmtree(out / RESUME_MODEL, ignore_errors=True)
    m = report["metrics"]
    log(f"AA {m['AA']:.4f}, BWT {_fmt(m['BWT'])}, FWT {_fmt(m['FWT'])}, general forgetting "
        f"{report['general_forgetting']:+.4f}; report: {out / 'report.md'}")
    parallel.barrier(device)  # every rank returns once rank 0 has written the run
    return report


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:+.4f}"


def build_report(cfg, tasks, rows, per_task, history, device, bf16, seconds) -> Dict:
    matrix = [r["scores"] for r in rows]
    return {"config": asdict(cfg), "method": cfg.method,
            "tasks": [{"name": t.name, "kind": t.kind, "metric": t.metric, "train_blocks": int(t.train["input_ids"].shape[0]),
                       "held_out": min(int(t.held["input_ids"].shape[0]), cfg.eval_blocks)} for t in tasks],
            "matrix": matrix, "rows": rows, "metrics": metrics(matrix),
            "general_loss": [r["general_loss"] for r in rows],
            "general_forgetting": rows[-1]["general_loss"] - rows[0]["general_loss"],
            "trainable_parameters": [p["trainable_parameters"] for p in per_task],
            "per_task": per_task, "history": history,
            "machine": {"device": str(device), "threads": torch.get_num_threads(), "bf16": bf16},
            "wall_seconds": round(seconds, 1)}


def write_report(report: Dict, out: Path):
    names = [t["name"] for t in report["tasks"]]
    labels = [r["label"] for r in report["rows"]]
    plot_matrix(report["matrix"], labels, [f"{n}\n({t['metric']})" for n, t in zip(names, report["tasks"])],
                out / "matrix.png", f"{report['method']}: score on each task (column) after each task (row)")
    plot_series(labels, report["general_loss"], out / "general.png", "general held-out loss",
                f"{report['method']}: general loss across the sequence")
    atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
    atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(markdown_report(report)))


def markdown_report(report: Dict) -> str:
    cfg, m = report["config"], report["metrics"]
    names = [t["name"] for t in report["tasks"]]
    lines = [f"# adept_ext continual run: {report['method']}", "",
             f"Model `{cfg['model']}`, tasks {' → '.join(names)}, general corpus `{cfg['general']}` (held out); "
             f"{cfg['steps']} steps per task of {cfg['grad_accum']} micro-batch(es) x {cfg['batch_size']} blocks x "
             f"{cfg['block_len']} tokens, lr {cfg['lr']}, seed {cfg['seed']}, device {report['machine']['device']}.", "",
             "Score a[t][i] = accuracy (instruction tasks: exact match of the greedy answer) or −loss (text tasks: "
             "held-out next-token loss) on task i after training through task t.", "",
             "| after | " + " | ".join(f"{n} ({t['metric']})" for n, t in zip(names, report["tasks"])) + " | general loss |",
             "|---|" + "---|" * (len(names) + 1)]
    lines += [f"| {r['label']} | " + " | ".join(f"{s:.4f}" for s in r["scores"]) + f" | {r['general_loss']:.4f} |"
              for r in report["rows"]]
    lines += ["", f"AA {m['AA']:.4f}; BWT {_fmt(m['BWT'])}; FWT {_fmt(m['FWT'])}; general forgetting "
                  f"(general loss after the last task − base) {report['general_forgetting']:+.4f}.", "",
              "| task | what trained | trainable parameters | seconds | peak memory MB |", "|---|---|---|---|---|"]
    lines += [f"| {p['task']} | {p['summary']} | {p['trainable_parameters'] / 1e6:.2f}M | {p['seconds']} | "
              f"{p['peak_memory_mb']} |" for p in report["per_task"]]
    lines += ["", f"Wall time {report['wall_seconds']} s. Plots: `matrix.png`, `general.png`."]
    return "\n".join(lines) + "\n"
