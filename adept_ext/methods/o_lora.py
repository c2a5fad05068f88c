"""O-LoRA (Wang et al., EMNLP 2023 Findings; docs/methods.md §5): a new LoRA (A_t, B_t) per task with the
earlier tasks' LoRA frozen, and an orthogonality penalty between the new subspace and the old
ones, loss = L_task + λ Σ_{i<t} ‖A_i A_tᵀ‖²_F per adapted projection (A of shape [r, d_in] as
PEFT stores it; λ = `lam`, option `o_lora_lambda`, default 0.5). The earlier adapters are merged
into the weights after their task — the same function as keeping them frozen beside it — and
their A's are kept for the penalty.
"""
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import torch

from .base import option, register
from .lora import SeqLora, SeqLoraConfig, lora_adapters


@dataclass(kw_only=True)
class OLoraConfig(SeqLoraConfig):
    """Each task's LoRA rank, and the penalty's weight λ."""

    method: ClassVar[str] = "o_lora"
    lam: float = option(0.5, "o_lora_lambda")

    def __post_init__(self):
        super().__post_init__()
        self.require("lam", self.lam >= 0, "must be >= 0")


@register
class OLora(SeqLora):
    name = "o_lora"
    config_class = OLoraConfig
    description = "O-LoRA: a LoRA per task, orthogonal to the earlier tasks' LoRA subspaces"
    shardable = False  # the penalty reads the adapters' whole A outside the forward pass

    def __init__(self, config):
        super().__init__(config)
        self.previous: Dict[str, torch.Tensor] = {}  # module name -> earlier A's stacked [Σ r_i, d_in]

    def penalties(self, model) -> List[torch.Tensor]:
        """λ·Σ_i ‖A_i A_tᵀ‖²_F over every adapted projection and earlier task i (docs/methods.md §5)."""
        if not self.previous or self.config.lam == 0:
            return []
        penalty = None
        for name, layer in lora_adapters(model):
            a = layer.lora_A["default"].weight
            old = self.previous[name]
            if old.device != a.device:
                old = self.previous[name] = old.to(a.device)
            term = (old @ a.float().T).square().sum()
            penalty = term if penalty is None else penalty + term
        return [self.config.lam * penalty]

    def end_task(self, model, out, report: Dict):
        for name, layer in lora_adapters(model):
            a = layer.lora_A["default"].weight.detach().float()
            self.previous[name] = torch.cat([self.previous[name], a]) if name in self.previous else a.clone()
        return super().end_task(model, out, report)

    def state_dict(self) -> Dict:
        return {"previous": {n: a.cpu() for n, a in self.previous.items()}}

    def load_state_dict(self, state: Dict):
        self.previous = dict(state["previous"])
