"""LwF (Learning without Forgetting, Li & Hoiem, ECCV 2016) on seq_lora, as continual LLM frameworks
apply it (EasyCL's `lwf`; docs/methods.md §5, "LwF"): from the second task on, the loss of a batch is

    (1 − α) · CE + α · T² · (1/N) Σ_i KL(p_prev(· | x_<i)^(T) ‖ p_θ(· | x_<i)^(T))

over the N positions the cross-entropy scores (those whose next token is labelled), p^(T) the softmax
of the logits / T, p_prev the model after the previous task. On seq_lora that model is the current one
with the task's adapter disabled (the earlier tasks are merged into its weights): no second copy of
the weights, one extra forward without gradients per micro-batch.
"""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..lm_loss import IGNORE_INDEX, final_hidden
from ..models import adapter, base_model
from ..models.packed_attention import packed_layout
from .base import option, register
from .lora import SeqLora, SeqLoraConfig


@dataclass(kw_only=True)
class LwfConfig(SeqLoraConfig):
    """α and T of the distillation (EasyCL's defaults), on seq_lora of rank `lora_rank`."""

    method: ClassVar[str] = "lwf"
    alpha: float = option(0.5, "lwf_alpha", help=(
        "α: the loss is (1 − α)·cross-entropy + α·T²·KL(previous model ‖ model) on the labelled positions"))
    temperature: float = option(2.0, "lwf_temperature", help="T of the distillation's softmax")

    def __post_init__(self):
        super().__post_init__()
        self.require("alpha", 0 <= self.alpha < 1, "must be in [0, 1)")
        self.require("temperature", np.isfinite(self.temperature) and self.temperature > 0, "must be > 0")


def distillation_sum(teacher: torch.Tensor, student: torch.Tensor, temperature: float) -> torch.Tensor:
    """Σ over rows of KL(softmax(teacher / T) ‖ softmax(student / T)) · T², logits [N, V] (float32)."""
    target = (teacher.float() / temperature).log_softmax(-1)
    current = (student.float() / temperature).log_softmax(-1)
    return (target.exp() * (target - current)).sum() * temperature ** 2


@register
class Lwf(SeqLora):
    name = "lwf"
    config_class = LwfConfig
    description = "seq_lora distilled toward the previous task's model on the new task's inputs (LwF)"
    own_loss_terms = True  # the teacher's forward: hf.MethodCallback cannot add it
    records_subspaces = False
    shardable = False  # the adapter is switched off for the teacher's forward
    task_index = 0  # the task being learned (`prepare`)

    def prepare(self, model, ctx, layers=None):
        self.task_index = ctx.task_index
        setup = super().prepare(model, ctx, layers)
        if self.task_index and self.config.alpha:
            setup.summary += (f", distilled toward the previous task's model (α = {self.config.alpha:g}, "
                              f"T = {self.config.temperature:g})")
        return setup

    def loss(self, model, batch, loss_implementation: str = "auto", num_items=None, micro_batches: int = 1):
        """seq_lora's loss, and from the second task the distillation term (module docstring), each divided
        by the step's labelled tokens (`num_items`)."""
        if not self.task_index or not self.config.alpha:
            return super().loss(model, batch, loss_implementation, num_items, micro_batches)
        labels = batch["labels"]
        scored = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX
        total = scored.sum() if num_items is None else num_items
        inputs = {k: v for k, v in packed_layout(model, batch).items() if k != "labels"}
        with torch.no_grad(), self.peft_model.disable_adapter(), final_hidden(model) as caught:
            model(**inputs, use_cache=False, logits_to_keep=labels.new_empty(0))
        teacher = caught[-1][scored]
        with final_hidden(model) as caught:
            token_loss = super().loss(model, batch, loss_implementation, total, micro_batches)
        head = adapter(base_model(model))
        kl = distillation_sum(head.head_logits(teacher), head.head_logits(caught[-1][scored]),
                              self.config.temperature)
        return (1 - self.config.alpha) * token_loss + self.config.alpha * kl / total
