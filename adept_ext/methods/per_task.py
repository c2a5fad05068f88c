"""The per-task oracle (PerTaskFT in DEAL's tables, arXiv 2509.18942; docs/methods.md §5): a fresh rank-r
PEFT LoRA per task on the unchanged base model, and task i always scored with its own adapter
(`scoring`), the base model before task i is learned. Nothing is shared between tasks, so there
is no forgetting (BWT = 0 exactly) and no transfer; it bounds what one model per task reaches on
the sequence. The saved model is the base model, unchanged (so the general loss never moves);
each task's adapter is saved in its task folder, `task-<i>-<name>/adapter/` (PEFT's
save_pretrained; load it with `peft.PeftModel.from_pretrained(base, folder)`)."""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import torch

from .base import register
from .lora import SeqLora, SeqLoraConfig, add_lora


@dataclass(kw_only=True)
class PerTaskConfig(SeqLoraConfig):
    """Each task's LoRA rank."""

    method: ClassVar[str] = "per_task"


@register
class PerTask(SeqLora):
    records_subspaces = False  # keeps whole adapters instead
    dense_result = False  # keeps its tasks' adapters and composes the model itself
    name = "per_task"
    config_class = PerTaskConfig
    description = "oracle: a fresh LoRA per task on the base model, each task scored with its own adapter"

    def __init__(self, config):
        super().__init__(config)
        self.adapters: List[Dict[str, torch.Tensor]] = []  # task i's LoRA weights (PEFT's state-dict keys)

    def end_task(self, model, out, report: Dict):
        """Keep (and save) the task's adapter and return the base model without it."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft_model)
        self.adapters.append({k: v.detach().cpu().clone() for k, v in state.items()})
        if out is not None:
            self.peft_model.save_pretrained(out / "adapter")
        model = self.peft_model.unload()
        self.peft_model = None
        return model

    @contextmanager
    def scoring(self, model, task_index: int):
        if task_index >= len(self.adapters):
            yield model
            return
        from peft import set_peft_model_state_dict

        scored = add_lora(model, self.config.rank)
        set_peft_model_state_dict(scored, self.adapters[task_index])
        try:
            yield scored
        finally:
            scored.unload()

    def state_dict(self) -> Dict:
        return {"adapters": list(self.adapters)}

    def load_state_dict(self, state: Dict):
        self.adapters = list(state["adapters"])
