"""Online EWC (Kirkpatrick et al., PNAS 2017; the online form of Schwarz et al., ICML 2018), on seq_lora
or seq_full (docs/methods.md §5, "EWC"): the task loss plus

    (λ/2) Σ_i F_i (w_i − w*_i)²,      F ← γ F + F_t,      F_t,i = (1/N) Σ_n (∂ℓ_n/∂w_i)²

with w* the weights after the previous task, F_t the diagonal empirical Fisher of task t (ℓ_n the mean
next-token loss of training row n, N = `ewc_samples` rows, per-row gradients), computed when the task
ends on the model as trained. On seq_lora (`ewc_base lora`) w ranges over the adapted projections'
weights: a task's adapter starts at zero and is merged at its end, so w − w* is the adapter's own
product s·B A (PEFT's `get_delta_weight`) and no copy of w* is kept; on seq_full (`ewc_base full`)
over every parameter, w* a copy.
"""
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple

import numpy as np
import torch

from ..errors import InputError
from ..lm_loss import IGNORE_INDEX, next_token_loss
from ..merge_back import finished_name
from .base import Method, MethodConfig, get_method, option, register
from .lora import lora_adapters, sequential_config

BASES = ("lora", "full")


@dataclass(kw_only=True)
class EwcConfig(MethodConfig):
    """λ, γ, the rows of each task's Fisher and the method the penalty is added to."""

    method: ClassVar[str] = "ewc"
    strength: float = option(1e4, "ewc_lambda", help="λ of the penalty (λ/2) Σ F (w − w*)²")
    decay: float = option(1.0, "ewc_gamma", help=(
        "γ of online EWC, F ← γ F + F_t after each task (1: the tasks' Fishers summed; 0: the last task's only)"))
    samples: int = option(64, "ewc_samples", help=(
        "training rows of a task whose per-row squared gradients are its Fisher"))
    base: str = option("lora", "ewc_base", help=(
        "on seq_lora's adapted projections (lora) or every weight of seq_full (full)"))
    rank: int = option(8, "lora_rank", help="LoRA rank of the seq_lora base (ewc_base lora)")
    freeze_bottom: int = option(0, "freeze_bottom", help=(
        "after the first task, the embeddings and the decoder layers below this one do not train (either base)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("strength", np.isfinite(self.strength) and self.strength >= 0, "must be a finite number >= 0")
        self.require("decay", 0 <= self.decay <= 1, "must be in [0, 1]")
        self.require("samples", self.samples >= 1, "must be >= 1")
        self.require_one_of("base", BASES)
        self.base_config()

    def base_config(self):
        """The config of the method this one builds on (`lora.sequential_config`)."""
        return sequential_config(self.base, self.rank, self.freeze_bottom)


@register
class Ewc(Method):
    name = "ewc"
    config_class = EwcConfig
    description = "seq_lora (or seq_full) with online EWC's Fisher-weighted penalty on the change from the last task"
    single_domain = False
    sequence = True
    shardable = False  # the penalty reads whole weights (the adapters' products)

    def __init__(self, config):
        super().__init__(config)
        self.base = get_method(config.base_config())
        self.trains_every_weight = self.base.trains_every_weight
        self.fisher: Dict[str, torch.Tensor] = {}  # finished weight name -> F (float32, host until a task moves it)
        self.anchor: Dict[str, torch.Tensor] = {}  # ewc_base full: w* by name
        self.rows = None  # the current task's training rows (`train_blocks`), the Fisher's

    def check(self, model):
        self.base.check(model)

    def prepare(self, model, ctx, layers=None):
        setup = self.base.prepare(model, ctx, layers)
        if self.fisher:
            setup.summary += f", online EWC (λ = {self.config.strength:g}) over {len(self.fisher)} weights"
        return setup

    def train_blocks(self, blocks, task_index: int):
        self.rows = blocks[task_index]  # the Fisher's rows, read when the task ends
        return self.base.train_blocks(blocks, task_index)

    def extra_bytes(self, trainable) -> int:
        return sum(4 * f.numel() for f in self.fisher.values()) * (2 if self.config.base == "full" else 1)

    def covered(self, model) -> Dict[str, torch.nn.Parameter]:
        """The weights the penalty covers, by their name once the task is finished: the adapted
        projections' base weights (lora), or every parameter (full)."""
        if self.config.base == "lora":
            return {finished_name(f"{name}.base_layer.weight"): layer.base_layer.weight
                    for name, layer in lora_adapters(model)}
        return dict(model.named_parameters())

    def penalties(self, model) -> List[torch.Tensor]:
        if not self.fisher or not self.config.strength:
            return []
        total = 0.0
        if self.config.base == "lora":
            for name, layer in lora_adapters(model):
                fisher = self.on(self.fisher, finished_name(f"{name}.base_layer.weight"), layer.base_layer.weight)
                total = total + (fisher * layer.get_delta_weight("default").float().pow(2)).sum()
        else:
            for name, p in model.named_parameters():
                if name in self.fisher:
                    change = p.float() - self.on(self.anchor, name, p)
                    total = total + (self.on(self.fisher, name, p) * change.pow(2)).sum()
        return [0.5 * self.config.strength * total]

    @staticmethod
    def on(store: Dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        """`store[name]` on `like`'s device (moved there once)."""
        if store[name].device != like.device:
            store[name] = store[name].to(like.device)
        return store[name]

    def task_fisher(self, model, rows) -> Tuple[Dict[str, torch.Tensor], int]:
        """F_t over the first `ewc_samples` rows of `rows` that have a labelled token: the mean of each
        row's squared gradient of its mean next-token loss, float32 on the host; and that row count."""
        params = self.covered(model)
        requires = {name: p.requires_grad for name, p in params.items()}
        sums = {name: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for name, p in params.items()}
        device, was_training, counted = next(model.parameters()).device, model.training, 0
        model.eval()
        try:
            for p in params.values():
                p.requires_grad_(True)
            for i in range(len(rows)):
                if counted == self.config.samples:
                    break
                row = rows.rows([i])
                if not (row["labels"][:, 1:] != IGNORE_INDEX).any():
                    continue
                loss = next_token_loss(model, {k: v.to(device) for k, v in row.items()})
                for total, grad in zip(sums.values(), torch.autograd.grad(loss, list(params.values()))):
                    total.add_(grad.float().pow(2))
                counted += 1
        finally:
            for name, p in params.items():
                p.requires_grad_(requires[name])
            model.train(was_training)
        if not counted:
            raise InputError("ewc: the task has no training row with a labelled token to estimate its Fisher from")
        return {name: (total / counted).cpu() for name, total in sums.items()}, counted

    def end_task(self, model, out, report):
        """The task's Fisher (on the model as trained, before the base merges), folded into F; then the
        base's end (merge); with ewc_base full, w* = the weights now."""
        if self.rows is not None:
            fisher, counted = self.task_fisher(model, self.rows)
            self.fisher = {name: f + self.config.decay * self.fisher[name].to(f.device) if name in self.fisher else f
                           for name, f in fisher.items()}
            report["ewc"] = {"fisher_rows": counted, "weights": len(self.fisher),
                             "fisher_mean": float(sum(f.sum() for f in fisher.values())
                                                  / sum(f.numel() for f in fisher.values()))}
        model = self.base.end_task(model, out, report)
        if self.config.base == "full":
            self.anchor = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
        return model

    def state_dict(self) -> Dict:
        return {"base": self.base.state_dict(), "fisher": {n: f.cpu() for n, f in self.fisher.items()},
                "anchor": {n: a.cpu() for n, a in self.anchor.items()}}

    def load_state_dict(self, state: Dict):
        self.base.load_state_dict(state["base"])
        self.fisher, self.anchor = dict(state["fisher"]), dict(state["anchor"])
