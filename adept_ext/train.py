"""The main job: continual pretraining of a causal LM on a domain corpus while keeping its
general ability — ADEPT (docs/methods.md §1) and the baselines it is compared with, on the same data and
token budget. The methods live in `adept_ext.methods` behind one registry; this runner only
calls their hooks.

`run(RunConfig(...))` loads the model and both corpora, measures the base model's held-out
general and domain loss, and hands the one task to the training engine (`training.fit_task`:
the method's `prepare` — probe + expansion for ADEPT —, AdamW with warmup + cosine, gradient
accumulation and clipping, bf16 autocast where `--bf16` turns it on, atomic checkpoints from
which a killed run resumes to the same result); it adds the periodic and final held-out
evaluations and the LayerTracer diagnosis inputs (an `auto` boundary), and writes the adapted
model (a plain Hugging Face checkpoint), report.json, report.md, the loss curves and the
method's own plots.
Under torchrun the ranks train with DistributedDataParallel or FSDP2 and rank 0 writes. What both
runners share (the options they both take, evaluation, the loop, checkpoints, run directories)
lives in `adept_ext.training`; the task-sequence runner is `continual.py`.
"""
import logging
import json
import math
import platform
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Collection, Dict

import torch

from . import data, parallel
from .models import held, load_model, place_model
from .evaluation import harness
from .errors import InputError, RunError
from .data.truncation import report_entries
from .methods import create, method_names
from .methods.base import option
from .methods.freeze_deep import DIAGNOSIS_TASKS
from .lm_loss import loss_path
from .models.packed_attention import check_packing
from .report import plot_loss_curves
from .training.one_domain import RunHooks, diagnosis_batches, evaluated_held, merged_back
from .training.markdown import run_markdown
from .training.options import TOOLS
from .training import (CHECKPOINT, BenchmarkOptions, MergeBackOptions, Tracker, TrainOptions, atomic_dir, atomic_write,
                       check_memory, check_merge_back, check_out, device_for, fit_task, frozen_dtype_for,
                       held_as_frozen, options_from, prepare_out, read_checkpoint, remove_stale_shards, use_bf16,
                       with_method_options)

logger = logging.getLogger(__name__)
METHODS = tuple(method_names(single_domain=True))


@dataclass
class RunOptions(MergeBackOptions, BenchmarkOptions, TrainOptions):
    """The options of a one-domain run that are the runner's own (the embedded default: SmolLM2-135M,
    BBC News as general corpus, Python docs as domain corpus, sized for a few minutes on 2 CPU
    cores); `RunConfig` adds the single-domain methods' options."""

    general: str = option("bbc-news", commands=TOOLS, help=(
        "general-domain corpus: text file, folder, JSONL with 'text', or bbc-news / python-docs"))
    domain: str = option("python-docs", commands=("eval", "diagnose"), help=(
        "domain corpus to adapt to (same forms as --general), or several, comma-separated, interleaved by "
        "--domain-weights"))
    domain_weights: str = option("", help=(
        "weights of --domain's comma-separated sources (LLaMA-Factory's interleave_probs), e.g. 0.7,0.3: each "
        "training block comes from source j with probability w_j / sum(w) until every source has given every block "
        "(a light source repeats; nothing is dropped), and the held-out blocks are interleaved alike, each once; "
        "default: equal weights"))
    domain_eval: str = option("", commands=("eval",), help=(
        "a fixed held-out set for the domain (TRL's eval_dataset; same forms as --domain): its first --eval-blocks "
        "blocks are evaluated and every block of --domain trains; default: a random tenth of --domain held out"))
    # 4 and 8 probe blocks choose the same layers of the embedded model at half the probe's time
    probe_blocks: int = option(4, commands=("probe", "expand", "diagnose"),
                               help="general blocks used to probe layers and score units")
    eval_every: int = option(20, resumable=True, help="held-out evaluation every N steps (0 = only at the end)")
    diagnosis_task: str = option("bbc-topic", commands=("diagnose",), help=(
        "LayerTracer inputs: bbc-topic (few-shot BBC News topic classification) or context (general blocks, first "
        "half as context)"))
    diagnosis_queries: int = option(8, commands=("diagnose",),
                                    help="composite inputs (queries) of the LayerTracer diagnosis")
    streaming: bool = option(False, help=(
        "read the corpora as streams through Hugging Face datasets: corpus order, no cache, only what the run "
        "consumes is read (for corpora too large to tokenise up front)"))


def run_config_class() -> type:
    """Every option of a one-domain run: the runner's (`RunOptions`) and the single-domain methods'."""
    return with_method_options(RunOptions)


RunConfig = run_config_class()  # the built-in methods' options; a method registered later: run_config_class()


def config_from(overrides: Dict, given: Collection[str] = ()) -> RunConfig:
    """A checked RunConfig from a dict of options (flags, TOML); `given`: the options the user gave
    (an option of another method among them is refused)."""
    if isinstance(overrides.get("layers"), list):  # TOML: layers = [7, 14]
        overrides = {**overrides, "layers": ",".join(map(str, overrides["layers"]))}
    if isinstance(overrides.get("boundary"), int):  # TOML: boundary = 12
        overrides = {**overrides, "boundary": str(overrides["boundary"])}
    cfg = options_from(run_config_class(), overrides, given=given)
    if cfg.packing and cfg.streaming:
        raise RunError("--packing reads whole documents into rows by best-fit decreasing over the corpus, which "
                       "--streaming does not hold: drop one of them")
    if cfg.mix_general and cfg.streaming:
        raise RunError("--mix-general draws from the general corpus's shuffled training split, which --streaming "
                       "does not build: drop one of them")
    if cfg.streaming and cfg.dataloader_num_workers > 1:
        raise RunError(f"--streaming reads the domain corpus as one stream in corpus order, which one loader process "
                       f"does (Hugging Face datasets would split the corpus's files among several): "
                       f"--dataloader-num-workers 0 or 1, not {cfg.dataloader_num_workers}")
    data.domain_sources(cfg)  # RunError for weights that do not fit the sources
    if cfg.streaming and len(data.domain_sources(cfg)[0]) > 1:
        raise RunError("--streaming reads one domain corpus in order; several --domain sources are interleaved from "
                       "their shuffled splits: give one source, or drop --streaming")
    if cfg.eval_every < 0:
        raise RunError(f"eval_every must be >= 0 (0 = only at the end), got {cfg.eval_every}")
    if cfg.diagnosis_queries < 1:
        raise RunError(f"diagnosis_queries must be >= 1, got {cfg.diagnosis_queries}")
    if cfg.domain_eval and not (cfg.domain_eval in data.BUILTIN_CORPORA or Path(cfg.domain_eval).exists()):
        raise RunError(f"--domain-eval {cfg.domain_eval}: no such file or folder")
    check_merge_back(cfg, auto=True)
    if cfg.diagnosis_task not in DIAGNOSIS_TASKS:
        raise RunError(f"diagnosis_task must be one of {', '.join(DIAGNOSIS_TASKS)}, got {cfg.diagnosis_task!r}")
    return cfg


def run(cfg: RunConfig, progress: bool = True, log=logger.info) -> Dict:
    """All stages of a run; returns the report (also written to `cfg.out`). Under torchrun
    (WORLD_SIZE > 1) the ranks train one model with DistributedDataParallel (or FSDP2 under
    `parallel="fsdp2"`) and rank 0 writes."""
    device = device_for(cfg)
    return parallel.run_on_ranks(device, lambda progress_, log_: _run(cfg, device, progress_, log_), progress, log)


def _run(cfg: RunConfig, device, progress, log) -> Dict:
    started = time.time()
    main = parallel.is_main()
    bf16 = use_bf16(cfg, device)
    checkpoint = read_checkpoint(check_out(cfg, "run")) if cfg.resume else None
    if checkpoint and cfg.drift_tokens and checkpoint.get("drift_reference") is None:
        raise RunError(f"the checkpoint in {cfg.out} was written before the drift signal existed (it holds no base "
                       "distributions): resume it with --drift-tokens 0")
    method = create(cfg.method, cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        frozen = frozen_dtype_for(cfg, bf16)  # held from the load on (docs/design.md, "Precision")
        hold = frozen if frozen != torch.float32 else None
        model, tokenizer = load_model(cfg.model, device=device, attn_implementation=cfg.attn_implementation,
                                      hold=hold)
        method.check(model)
        if cfg.packing:
            check_packing(model, cfg.batch_size, torch.bfloat16 if bf16 else None)  # as the steps run
        loss = loss_path(model, cfg.loss_implementation)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    check_memory(cfg, model, bf16)
    try:
        corpora = data.Corpora(cfg, tokenizer)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    out = prepare_out(cfg, "run") if main else Path(cfg.out)
    parallel.barrier(device)
    machine = {"device": str(device), "threads": torch.get_num_threads(), "platform": platform.platform(),
               "bf16": bf16, "processes": parallel.world_size()}
    report = {"config": asdict(cfg), "stages": {}, "machine": machine, "loss": loss,
              "data": report_entries(corpora.sources, log)}
    log(f"loss: {loss}")
    history = checkpoint["task_history"] if checkpoint else {"train": [], "eval": []}
    tracker = Tracker(cfg.report_to, out, asdict(cfg), cfg.method)
    try:
        hooks = RunHooks(cfg, model, corpora, out, report, history, device, tracker, progress, log)
        hooks.tokenizer = tokenizer
        hooks.first_step = checkpoint["step"] if checkpoint else 0
        hooks.drift_reference = checkpoint.get("drift_reference") if checkpoint else None
        with nullcontext() if checkpoint else held_as_frozen(model, cfg, bf16):  # the base as the steps see it
            base = hooks.base = checkpoint["base"] if checkpoint else hooks.evaluate(0, " (base)", base=True)
            hooks.stage("base_eval", **base)
            log(f"base model: general loss {base['general_loss']:.4f}, domain loss {base['domain_loss']:.4f}")
            hooks.base_benchmarks = checkpoint.get("base_benchmarks") if checkpoint else \
                harness.for_run(cfg, model, tokenizer, out / "benchmark_samples_base.jsonl", tracker, 0, "base", log)
        if hooks.base_benchmarks:
            hooks.stage("base_benchmarks")
        fit = fit_task(model, method, cfg, device, bf16, lambda task: corpora.domain_train, history, out=out,
                       desc=f"training ({cfg.method})", general_probe=corpora.general_probe,
                       domain_probe=corpora.domain_probe, diagnosis_batches=lambda: diagnosis_batches(cfg, corpora),
                       checkpoint=checkpoint, hooks=hooks, artifacts=out if main else None, report=report,
                       tracker=tracker, progress=progress, log=log,
                       to_host=hold is not None or cfg.frozen_dtype == "nf4")  # merged and saved on the host
        final, final_benchmarks, model = hooks.final, hooks.final_benchmarks, fit["model"]
        if cfg.merge_back:
            if hold is not None or cfg.frozen_dtype == "nf4":  # finished on the host: on the device, held, to score
                place_model(model, device, torch.float32, hold)
            final, report["merge_back"] = merged_back(cfg, model, hooks, fit["step"], out if main else None, log)
            hooks.stage("merge_back", alpha=report["merge_back"]["alpha"])
            final_benchmarks = harness.for_run(cfg, model, tokenizer, out / "benchmark_samples_final.jsonl", tracker,
                                               fit["step"], "final", log)
            held.export_exact(model)  # saved exact, from the host
    finally:
        tracker.close()
    task, n_trainable = fit["task"], fit["trainable"]
    if main:
        atomic_dir(out / "model", lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        plot_loss_curves(history, base, out / "loss_curves.png", title=f"{cfg.method}: training and held-out loss")
    hooks.stage("save")

    report.update({
        "method": cfg.method, "layers": task.layers, "summary": task.summary, "base": base, "final": final,
        "forgetting_general_delta": final["general_loss"] - base["general_loss"],
        "gain_domain_delta": base["domain_loss"] - final["domain_loss"],
        "perplexity": {"base_general": math.exp(base["general_loss"]), "final_general": math.exp(final["general_loss"]),
                       "base_domain": math.exp(base["domain_loss"]), "final_domain": math.exp(final["domain_loss"])},
        "evaluated_held": evaluated_held(cfg, bf16),
        **({"drift": {"tokens": sum(len(r) for r in hooks.drift_reference), "kl_to_base": final["kl_to_base"]}}
           if cfg.drift_tokens else {}),
        "trainable_parameters": n_trainable, "trainable_fraction": report["stages"]["prepare"]["trainable_fraction"],
        "memory_estimate_mb": fit["memory_estimate_mb"],
        "history": history, "plots": sorted(p.name for p in out.glob("*.png")),
        **({"benchmarks": {"base": hooks.base_benchmarks, "final": final_benchmarks,
                           "difference": harness.compare(hooks.base_benchmarks, final_benchmarks)}}
           if final_benchmarks else {}),
        "wall_seconds": round(time.time() - started, 1)})
    if main:
        atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
        atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(run_markdown(report)))
        (out / CHECKPOINT).unlink(missing_ok=True)  # the run is complete: the model replaces it
        remove_stale_shards(out)
    log(f"final: general loss {final['general_loss']:.4f} (forgetting {report['forgetting_general_delta']:+.4f}), "
        f"domain loss {final['domain_loss']:.4f} (gain {report['gain_domain_delta']:+.4f}); "
        f"report: {out / 'report.md'}")
    parallel.barrier(device)  # every rank returns once rank 0 has written the run
    return report
