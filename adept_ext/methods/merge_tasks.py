"""merge_tasks (docs/methods.md §5, "Merging the tasks"): every task trains a fresh rank-r LoRA on the
base model, and after each task the model is the base plus a merge of the task vectors learned so far,

    W = W₀ + merge(ΔW_1, …, ΔW_t),      ΔW_i = s·B_i A_i,

with PEFT's own merge functions (`peft.utils.merge_utils`: TIES, DARE-TIES, DARE-linear, task
arithmetic) on each adapted projection's exact ΔW (not on the factors, and without the rank truncation
of `add_weighted_adapter`'s `*_svd` forms). Tasks never see each other's updates while training; the
merge is what is scored and saved. DARE's random drops are seeded by the run's seed and the task.
"""
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple

import torch

from ..models import held
from ..merge_back import finished_name
from .base import option, register
from .lora import SeqLora, SeqLoraConfig, lora_adapters

COMBINATIONS = ("ties", "dare_ties", "dare_linear", "task_arithmetic")


@dataclass(kw_only=True)
class MergeTasksConfig(SeqLoraConfig):
    """How the tasks' LoRA are merged (PEFT's names), the share of each task vector kept, each task's weight."""

    method: ClassVar[str] = "merge_tasks"
    combination: str = option("ties", "merge_tasks_combination", help=(
        "PEFT's merge of the task vectors: ties, dare_ties, dare_linear or task_arithmetic"))
    density: float = option(0.5, "merge_tasks_density", help=(
        "share of each task vector's entries kept (TIES: the largest; DARE: a random draw, rescaled)"))
    weight: float = option(1.0, "merge_tasks_weight", help="every task vector's weight in the merge")

    def __post_init__(self):
        super().__post_init__()
        self.require_one_of("combination", COMBINATIONS)
        self.require("density", 0 < self.density <= 1, "must be in (0, 1]")
        self.require("weight", 0 < self.weight < float("inf"), "must be a finite number > 0")


def merged_delta(deltas: List[torch.Tensor], config: MergeTasksConfig) -> torch.Tensor:
    """PEFT's merge (`config.combination`) of one projection's task vectors, each weighted `config.weight`."""
    from peft.utils import merge_utils

    weights = torch.full((len(deltas),), config.weight, dtype=deltas[0].dtype)
    if config.combination == "task_arithmetic":
        return merge_utils.task_arithmetic(deltas, weights)
    if config.combination == "dare_linear":
        return merge_utils.dare_linear(deltas, weights, config.density)
    merge = merge_utils.ties if config.combination == "ties" else merge_utils.dare_ties
    return merge(deltas, weights, config.density, "total")


@register
class MergeTasks(SeqLora):
    name = "merge_tasks"
    config_class = MergeTasksConfig
    description = "a fresh LoRA per task on the base model, the tasks' updates merged by TIES or DARE (PEFT)"
    records_subspaces = False
    dense_result = False  # keeps its tasks' adapters and composes the model itself
    shardable = False  # the merge reads whole weights

    def __init__(self, config):
        super().__init__(config)
        self.base_weights: Dict[str, torch.Tensor] = {}  # adapted projection (finished name) -> W₀, exact, host
        self.factors: List[Dict[str, Tuple[torch.Tensor, torch.Tensor, float]]] = []  # per task: (A, B, s)
        self.seed = 0

    def prepare(self, model, ctx, layers=None):
        """The base weights back under the adapted projections (the last merge taken off), then a fresh adapter."""
        self.seed = ctx.seed
        params = dict(model.named_parameters())
        for name, value in self.base_weights.items():
            held.assign(model, params[name], value)
        setup = super().prepare(model, ctx, layers)
        if not self.base_weights:  # the first task: W₀ of every projection an adapter covers
            self.base_weights = {finished_name(f"{name}.base_layer.weight"):
                                 held.exact_value(model, layer.base_layer.weight).detach().to("cpu", copy=True)
                                 for name, layer in lora_adapters(self.peft_model)}
        setup.summary += f"; tasks merged by {self.config.combination} (density {self.config.density:g})"
        return setup

    def end_task(self, model, out, report):
        """Keep the task's factors, take the adapter off (unmerged), and set every adapted projection to
        W₀ + merge of the tasks' ΔW."""
        self.factors.append({finished_name(f"{name}.base_layer.weight"):
                             (layer.lora_A["default"].weight.detach().float().cpu().clone(),
                              layer.lora_B["default"].weight.detach().float().cpu().clone(),
                              float(layer.scaling["default"]))
                             for name, layer in lora_adapters(self.peft_model)})
        model = self.peft_model.unload()
        self.peft_model = None
        params = dict(model.named_parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1000 + len(self.factors))  # DARE's drops
            for name, base in self.base_weights.items():
                deltas = [s * b @ a for a, b, s in (task[name] for task in self.factors if name in task)]
                held.assign(model, params[name], base + merged_delta(deltas, self.config))  # task 1 covers all
        report["merge_tasks"] = {"tasks_merged": len(self.factors), "combination": self.config.combination,
                                 "density": self.config.density}
        return model

    def state_dict(self) -> Dict:
        return {"base_weights": self.base_weights, "factors": self.factors}

    def load_state_dict(self, state: Dict):
        self.base_weights, self.factors = dict(state["base_weights"]), list(state["factors"])
