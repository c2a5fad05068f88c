"""O-LoRA (Wang et al., EMNLP 2023 Findings; docs/methods.md §5): a new LoRA (A_t, B_t) per task with the
earlier tasks' LoRA frozen, and an orthogonality penalty between the new subspace and the old
ones, loss = L_task + λ Σ_{i<t} ‖A_i A_tᵀ‖²_F per adapted projection (A of shape [r, d_in] as
PEFT stores it; λ = `o_lora_lambda`, default 0.5). The earlier adapters are merged into the
weights after their task — the same function as keeping them frozen beside it — and their A's
are kept for the penalty.
"""
from typing import Dict

import torch

from .base import MethodError, register
from .lora import SeqLora, lora_adapters


@register
class OLora(SeqLora):
    name = "o_lora"
    description = "O-LoRA: a LoRA per task, orthogonal to the earlier tasks' LoRA subspaces"
    shardable = False  # the penalty reads the adapters' whole A outside the forward pass

    def __init__(self, cfg):
        super().__init__(cfg)
        if not cfg.o_lora_lambda >= 0:
            raise MethodError(f"o_lora_lambda must be >= 0, got {cfg.o_lora_lambda}")
        self.previous: Dict[str, torch.Tensor] = {}  # module name -> earlier A's stacked [Σ r_i, d_in]

    def loss(self, model, batch) -> torch.Tensor:
        loss = super().loss(model, batch)
        if not self.previous or self.cfg.o_lora_lambda == 0:
            return loss
        penalty = loss.new_zeros(())
        for name, layer in lora_adapters(getattr(model, "module", model)):  # under DDP: the wrapped model
            a = layer.lora_A["default"].weight
            old = self.previous[name]
            if old.device != a.device:
                old = self.previous[name] = old.to(a.device)
            penalty = penalty + (old @ a.float().T).square().sum()
        return loss + self.cfg.o_lora_lambda * penalty

    def end_task(self, model, out, report: Dict):
        for name, layer in lora_adapters(model):
            a = layer.lora_A["default"].weight.detach().float()
            self.previous[name] = torch.cat([self.previous[name], a]) if name in self.previous else a.clone()
        return super().end_task(model, out, report)

    def state_dict(self) -> Dict:
        return {"previous": {n: a.cpu() for n, a in self.previous.items()}}

    def load_state_dict(self, state: Dict):
        self.previous = dict(state["previous"])
