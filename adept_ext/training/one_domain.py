"""The one-domain runner's part of its task (`adept-ext run`): stage timings, the periodic and final
held-out evaluations with the drift signal (`RunHooks`), merging back toward the start with the
front of α (`merged_back`), how its evaluations hold the frozen weights (`evaluated_held`), and its
LayerTracer diagnosis inputs (`diagnosis_batches`, `run_diagnosis`)."""
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .. import merge_back, parallel
from ..errors import InputError, RunError
from ..evaluation import harness
from ..lens import Diagnosis, diagnose
from ..lens.inputs import context_query_task, fewshot_topic_task
from ..report import plot_merge_front
from . import drift
from .device import frozen_dtype_for, peak_memory_mb
from .loop import TaskHooks, evaluate
from .options import merge_back_alpha


class RunHooks(TaskHooks):
    """The one-domain run's part of the task: stage timings, artifacts, periodic and final
    evaluation (into the history and to the tracker)."""

    def __init__(self, cfg, model, corpora, out, report, history, device, tracker, progress, log):
        self.cfg, self.model, self.corpora, self.out, self.report = cfg, model, corpora, out, report
        self.history, self.device, self.tracker, self.progress, self.log = history, device, tracker, progress, log
        self.t0, self.first_step = time.time(), 0
        self.tokenizer = self.final_benchmarks = self.drift_reference = None

    def stage(self, name, **extra):
        self.report["stages"][name] = {"seconds": round(time.time() - self.t0, 2),
                                       "peak_memory_mb": round(peak_memory_mb(self.device)), **extra}
        self.t0 = time.time()

    def held_out_losses(self, label="") -> Dict[str, float]:
        """The model's general and domain held-out losses."""
        c = self.corpora
        return {name: evaluate(self.model, batches, self.device, f"eval {name.split('_')[0]}{label}", self.progress,
                               self.cfg.loss_implementation)
                for name, batches in (("general_loss", c.general_eval), ("domain_loss", c.domain_eval))}

    def evaluate(self, step: int, label="", group="eval", base=False, losses: Optional[Dict[str, float]] = None):
        """The held-out losses (`losses` where the caller has just computed them on this model) and, with
        --drift-tokens, the drift signal (`drift.mean_kl`; on the `base` model its reference is taken, and
        the base's own KL is 0), sent to the tracker as `group`/general_loss, `group`/domain_loss and
        `group`/kl_to_base."""
        c = self.corpora
        result = dict(losses) if losses is not None else self.held_out_losses(label)
        if self.cfg.drift_tokens and base:
            self.drift_reference = drift.base_distributions(self.model, c.general_eval, self.cfg.drift_tokens,
                                                            self.device)
            result["kl_to_base"] = 0.0
        elif self.cfg.drift_tokens:
            result["kl_to_base"] = drift.mean_kl(self.model, c.general_eval, self.drift_reference, self.device)
        self.tracker.log({f"{group}/{name}": value for name, value in result.items()}, step)
        return result

    def prepared(self, task, n_trainable):
        self.model, self.task = task.model, task
        if self.cfg.merge_back:  # θ₀ before any step (a resumed task is prepared anew: the same start)
            self.merge_start = merge_back.start_weights(task.model)
        total = sum(p.numel() for p in self.model.parameters())
        self.stage("prepare", layers=task.layers, trainable_parameters=n_trainable,
                   trainable_fraction=n_trainable / total)
        if parallel.is_main():
            task.method.write_artifacts(self.out)
        self.log(f"{self.cfg.method}: {task.summary}; trainable {n_trainable / 1e6:.1f}M ({n_trainable / total:.1%})")

    def after_step(self, step):
        if self.cfg.eval_every and step % self.cfg.eval_every == 0 and step < self.cfg.steps:
            self.history["eval"].append({"step": step, **self.evaluate(step)})

    def checkpoint_fields(self):
        return {"base": self.base, "base_benchmarks": self.base_benchmarks, "drift_reference": self.drift_reference}

    def trained(self, step):
        per_step = self.cfg.grad_accum * self.cfg.batch_size * self.cfg.max_length
        seconds = time.time() - self.t0
        self.stage("train", steps=step, tokens=step * per_step,  # tokens/s: per rank, the steps this process ran
                   tokens_per_second=round((step - self.first_step) * per_step / seconds, 1) if seconds else None)
        self.final = self.evaluate(step, " (final)")
        self.history["eval"].append({"step": step, **self.final})
        self.stage("final_eval", **self.final)

    def unsharded(self, step):
        if self.cfg.merge_back:  # scored on the merged model instead (`merged_back`)
            return
        self.final_benchmarks = harness.for_run(self.cfg, self.model, self.tokenizer,
                                                self.out / "benchmark_samples_final.jsonl", self.tracker, step,
                                                "final", self.log)
        if self.final_benchmarks:
            self.stage("final_benchmarks")


def merged_back(cfg, model, hooks, step: int, out: Optional[Path], log) -> Tuple[Dict, Dict]:
    """--merge-back on the finished `model` (`merge_back.MergeBack` from the start the task was prepared
    from): the held-out losses at each α (`merge_back.GRID` for auto, else the one given), the model left
    at the chosen α (auto: `merge_back.choose_alpha`), its evaluation as the run's final one (KL to the
    base included). Returns (that evaluation, report.json's "merge_back": the choice, the front with its
    Δloss from the base, the trained model's evaluation, the merge's seconds per α); merge_back.png in `out`."""
    hooks.model = model  # the finished model is what is scored from here on
    merger = merge_back.MergeBack(model, hooks.merge_start)
    fixed = merge_back_alpha(cfg)
    grid = [fixed] if fixed is not None else [a for a in merge_back.GRID if a >= cfg.merge_back_min]
    front, seconds = [], []
    for alpha in grid:
        started = time.perf_counter()
        merger.set(alpha, cfg.merge_back_schedule, cfg.merge_back_min)
        seconds.append(time.perf_counter() - started)
        losses = hooks.held_out_losses(f" (α={alpha:g})")
        front.append({"alpha": alpha, **losses, "general_delta": losses["general_loss"] - hooks.base["general_loss"],
                      "domain_delta": losses["domain_loss"] - hooks.base["domain_loss"]})
    chosen = fixed if fixed is not None else merge_back.choose_alpha(front, cfg.max_forgetting)
    merger.set(chosen, cfg.merge_back_schedule, cfg.merge_back_min)
    point = next(p for p in front if p["alpha"] == chosen)  # its losses: the front's, not evaluated again
    final = hooks.evaluate(step, group="merged", losses={k: point[k] for k in ("general_loss", "domain_loss")})
    log(f"merged back toward the start at α = {chosen:g} ({cfg.merge_back_schedule}): general loss "
        f"{final['general_loss']:.4f}, domain loss {final['domain_loss']:.4f} (trained: "
        f"{hooks.final['general_loss']:.4f}, {hooks.final['domain_loss']:.4f})")
    if out is not None and len(front) > 1:
        plot_merge_front(front, chosen, out / "merge_back.png",
                         title=f"{cfg.method}: merging back ({cfg.merge_back_schedule})")
    return final, {"alpha": chosen, "schedule": cfg.merge_back_schedule, "alpha_min": cfg.merge_back_min,
                   **({"max_forgetting": cfg.max_forgetting} if fixed is None else {}), "front": front,
                   "trained": hooks.final, "merge_seconds_per_alpha": round(sum(seconds) / len(seconds), 3)}


def evaluated_held(cfg, bf16: bool) -> Optional[str]:
    """How `run`'s evaluations hold the frozen weights (as the steps do): "nf4" (the decoder's linear
    layers in 4 bits, `quantize.hold_nf4`), "bfloat16", or None (exact)."""
    if cfg.frozen_dtype == "nf4":
        return "nf4"
    frozen = frozen_dtype_for(cfg, bf16)
    return None if frozen == torch.float32 else str(frozen).removeprefix("torch.")


def diagnosis_batches(cfg, corpora) -> List[Dict[str, torch.Tensor]]:
    """Composite inputs s_1 ⊕ s_2 for LayerTracer (docs/methods.md §3): few-shot BBC News topic
    classification (bbc-topic), or the general probe blocks split in half into context and
    query (context)."""
    if cfg.diagnosis_task == "bbc-topic":
        return fewshot_topic_task(corpora.tokenizer, n_queries=cfg.diagnosis_queries, shots=3, words=24,
                                       batch_size=cfg.batch_size, seed=cfg.seed)
    return context_query_task(corpora.general_context, cfg.max_length // 2)


def run_diagnosis(model, cfg, corpora, importance=None, progress=True) -> Diagnosis:
    """LayerTracer's logit lens and layer sensitivity on `cfg.diagnosis_task` (see lens.py)."""
    try:
        return diagnose(model, diagnosis_batches(cfg, corpora), importance, progress=progress)
    except (FileNotFoundError, InputError) as e:
        raise RunError(f"diagnosis: {e}") from e
