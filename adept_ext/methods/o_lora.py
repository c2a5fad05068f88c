"""O-LoRA (Wang et al., EMNLP 2023 Findings; docs/methods.md §5): a new LoRA (A_t, B_t) per task with the
earlier tasks' LoRA frozen, and an orthogonality penalty between the new subspace and the old
ones, loss = L_task + λ Σ_{i<t} ‖A_i A_tᵀ‖²_F per adapted projection (A of shape [r, d_in] as
PEFT stores it; λ = `lam`, option `o_lora_lambda`, default 0.5, the public code's); the public
code's entrywise L1 form λ Σ_{i<t} Σ|A_i A_tᵀ| with `--o-lora-penalty l1`. The earlier adapters are merged
into the weights after their task — the same function as keeping them frozen beside it — and
their A's are kept for the penalty.
"""
from dataclasses import dataclass
from typing import ClassVar, List

import torch

from .base import option, register
from .lora import SeqLora, SeqLoraConfig, lora_adapters


PENALTIES = ("fro2", "l1")


@dataclass(kw_only=True)
class OLoraConfig(SeqLoraConfig):
    """Each task's LoRA rank, the penalty's weight λ and its norm (`penalty`: fro2, the paper's
    squared Frobenius norm; l1, the public code's entrywise L1)."""

    method: ClassVar[str] = "o_lora"
    lam: float = option(0.5, "o_lora_lambda", help=(
        "weight of the orthogonality penalty between the new and the earlier LoRA A's"))
    penalty: str = option("fro2", "o_lora_penalty", help=(
        "the penalty's norm: `fro2` (the paper's squared Frobenius norm of A_i A_tᵀ) or `l1` (the public code's "
        "entrywise L1)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("lam", self.lam >= 0, "must be >= 0")
        self.require_one_of("penalty", PENALTIES)


@register
class OLora(SeqLora):
    name = "o_lora"
    config_class = OLoraConfig
    description = "O-LoRA: a LoRA per task, orthogonal to the earlier tasks' LoRA subspaces"
    shardable = False  # the penalty reads the adapters' whole A outside the forward pass

    def penalties(self, model) -> List[torch.Tensor]:
        """λ·Σ_i ‖A_i A_tᵀ‖²_F (fro2) or λ·Σ_i Σ|A_i A_tᵀ| (l1) over every adapted projection and
        earlier task i (docs/methods.md §5); the earlier A's are those SeqLora keeps."""
        if not self.previous or self.config.lam == 0:
            return []
        penalty = None
        for name, layer in lora_adapters(model):
            a = layer.lora_A["default"].weight
            old = self.previous[name]
            if old.device != a.device:
                old = self.previous[name] = old.to(a.device)
            overlap = old @ a.float().T
            term = overlap.square().sum() if self.config.penalty == "fro2" else overlap.abs().sum()
            penalty = term if penalty is None else penalty + term
        return [self.config.lam * penalty]
