"""The task-sequence runner's scores and report (`adept-ext continual`, docs/continual.md): the score
matrix's AA, BWT and FWT (`metrics`), the scores of a model on every task, the general corpus and its
drift from the base (`Evaluator`), the benchmarks of a row, what goes to the trackers, report.json,
report.md and the plots."""
import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .. import data
from ..models import held
from ..data.tasks import scored_by
from ..evaluation import harness
from ..evaluation.answers import answer_scores
from ..report import plot_matrix, plot_series
from . import drift
from .loop import evaluate
from .markdown import sequence_markdown
from .rundir import atomic_write


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
    """Scores of a model on every task's held-out split and on the general corpus, and its drift from
    the base model there (--drift-tokens: `drift.mean_kl` against `drift_reference`, taken on the base)."""

    def __init__(self, cfg, tasks, general_eval, device, eos_id, progress, method):
        self.cfg, self.tasks, self.general_eval, self.device = cfg, tasks, general_eval, device
        self.eos_id, self.progress, self.method = eos_id, progress, method
        self.drift_reference = None

    def row(self, model, label: str, base: bool = False) -> Dict:
        """Task i is scored on the model `method.scoring(model, i)` yields; the general corpus on `model`;
        under autocast where the model holds bfloat16 weights."""
        with held.autocast_for(model, self.device):  # the frozen weights held (bfloat16) as the steps see them
            row = self.scored_row(model, label)
        if self.cfg.drift_tokens and base:
            self.drift_reference = drift.base_distributions(model, self.general_eval, self.cfg.drift_tokens,
                                                            self.device)
            row["kl_to_base"] = 0.0
        elif self.cfg.drift_tokens:
            row["kl_to_base"] = drift.mean_kl(model, self.general_eval, self.drift_reference, self.device)
        return row

    def scored_row(self, model, label: str) -> Dict:
        scores, details = [], []
        for i, task in enumerate(self.tasks):
            held = task.held.first(self.cfg.eval_blocks).tensors()
            with self.method.scoring(model, i) as scored:
                if task.kind == "instruction":
                    result = answer_scores(scored, held, self.cfg.batch_size, self.device,
                                           None if task.replies else self.eos_id)
                    scores.append(result["accuracy"])
                else:
                    result = {"loss": evaluate(scored, data.batches(held, self.cfg.batch_size), self.device,
                                               f"eval {task.name} ({label})", self.progress,
                                               self.cfg.loss_implementation)}
                    scores.append(-result["loss"])
            details.append(result)
        general = evaluate(model, self.general_eval, self.device, f"eval general ({label})", self.progress,
                           self.cfg.loss_implementation)
        return {"label": label, "scores": scores, "details": details, "general_loss": general}


def save_exact(model, tokenizer, path):
    """The model, its held weights exact (`held.exact_state_dict`, from the host), config.json saying
    float32 (save_pretrained writes the dtype of the held weights there), and the tokenizer."""
    model.save_pretrained(path, state_dict=held.exact_state_dict(model))
    config = Path(path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "dtype": "float32"}, indent=2, sort_keys=True)
                      + "\n")
    tokenizer.save_pretrained(path)


def add_benchmarks(row: Dict, cfg, model, tokenizer, samples_path: Path, log):
    """lm-eval's scores of `model` (`--benchmarks`) into the score row `row` (nothing without benchmarks)."""
    scores = harness.for_run(cfg, model, tokenizer, samples_path, None, 0, row["label"], log)
    if scores:
        row["benchmarks"] = scores


def track_scores(tracker, tasks, rows, step: int):
    """The newest score row to the tracker: every task's score, the general loss, its benchmark scores
    (`--benchmarks`, where the row has them), and AA / BWT over the tasks learned so far."""
    done = len(rows) - 1
    scores = {f"continual/score/{task.name}": score for task, score in zip(tasks, rows[-1]["scores"])}
    running = metrics([row["scores"][:done] for row in rows]) if done else {}
    tracker.log({**scores, **harness.tracked(rows[-1].get("benchmarks")), "eval/general_loss": rows[-1]["general_loss"],
                 **({"eval/kl_to_base": rows[-1]["kl_to_base"]} if "kl_to_base" in rows[-1] else {}),
                 **{f"continual/{k}": v for k, v in running.items() if v is not None}}, step)


def build_report(cfg, tasks, rows, per_task, history, device, bf16, seconds, loss: str) -> Dict:
    matrix = [r["scores"] for r in rows]
    return {"config": asdict(cfg), "method": cfg.method,
            "tasks": [{"name": t.name, "kind": t.kind, "metric": t.metric, "scored_by": scored_by(t),
                       "train_blocks": len(t.train),
                       "held_out": min(len(t.held), cfg.eval_blocks)} for t in tasks],
            "matrix": matrix, "rows": rows, "metrics": metrics(matrix),
            "general_loss": [r["general_loss"] for r in rows],
            "general_forgetting": rows[-1]["general_loss"] - rows[0]["general_loss"],
            **({"kl_to_base": [r["kl_to_base"] for r in rows]} if "kl_to_base" in rows[-1] else {}),
            "trainable_parameters": [p["trainable_parameters"] for p in per_task],
            "per_task": per_task, "history": history,
            **({"benchmark_difference": harness.compare(rows[0]["benchmarks"], rows[-1]["benchmarks"])}
               if "benchmarks" in rows[-1] else {}),
            "machine": {"device": str(device), "threads": torch.get_num_threads(), "bf16": bf16}, "loss": loss,
            "wall_seconds": round(seconds, 1)}


def write_report(report: Dict, out: Path):
    names = [t["name"] for t in report["tasks"]]
    labels = [r["label"] for r in report["rows"]]
    plot_matrix(report["matrix"], labels, [f"{n}\n({t['metric']})" for n, t in zip(names, report["tasks"])],
                out / "matrix.png", f"{report['method']}: score on each task (column) after each task (row)")
    plot_series(labels, report["general_loss"], out / "general.png", "general held-out loss",
                f"{report['method']}: general loss across the sequence")
    atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
    atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(sequence_markdown(report)))
