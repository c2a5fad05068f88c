"""OSF, Orthogonal Subspace Fine-tuning (Nayak et al., 2025, "Sculpting Subspaces: Constrained Full
Fine-Tuning in LLMs for Continual Learning"), through PEFT's `OSFConfig`, as a continual method
(docs/methods.md §6). For task t (0-based) every adapted projection's weights W = U Σ Vᵀ (their SVD
at the task's start) are split at k_t: the top-k_t singular directions (U_high, Σ_high, V_high) are
frozen, the rest W_low = U_low diag(S_low) V_low trains, with the gradients of U_low and V_low
projected off the frozen directions,

    dU_low ← (I − U_high U_highᵀ) dU_low,    dV_low ← dV_low (I − V_highᵀ V_high).

After the task the change U_low S_low V_low − (its value at the start) is merged into the weights
(PEFT's `merge_and_unload`): the next task, and the saved model, is a plain Hugging Face model, and
the next SVD sees what the task learned.

The per-task schedule of PEFT's OSF guide (its preserved rank grows with every task):
k_t = r_0 + t·Δ, r_0 = `effective_rank` (option osf_effective_rank), Δ = `rank_step` (osf_rank_step);
values in (0, 1) are fractions of each projection's smaller dimension d (PEFT's rule: k = ⌊f·d⌋),
whole numbers ≥ 1 are counts of directions.
"""
import math
from dataclasses import dataclass
from typing import ClassVar, Dict, Union

import torch

from .base import Method, MethodConfig, MethodError, Setup, option, register
from .lora import target_modules


def _is_fraction(value) -> bool:
    return 0 < value < 1


def _is_count(value) -> bool:
    return math.isfinite(value) and value >= 1 and float(value).is_integer()


@dataclass(kw_only=True)
class OsfMethodConfig(MethodConfig):
    """The preserved rank of the first task and its growth per task (PEFT's `effective_rank`, here
    a schedule; not PEFT's `OSFConfig`: the method builds one per task)."""

    method: ClassVar[str] = "osf"
    effective_rank: float = option(0.3, "osf_effective_rank", help=(
        "preserved rank of the first task (PEFT's effective_rank): the top singular directions of each adapted "
        "projection that stay frozen; in (0, 1) a fraction of the projection's smaller dimension, a whole number "
        ">= 1 a count"))
    rank_step: float = option(0.2, "osf_rank_step", help=(
        "what the preserved rank grows by with each further task (PEFT's per-task schedule): 0, or of "
        "osf_effective_rank's kind (a fraction, or a whole number)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("effective_rank", _is_fraction(self.effective_rank) or _is_count(self.effective_rank),
                     "must be a fraction in (0, 1) or a whole number >= 1")
        same_kind = _is_fraction(self.rank_step) if self.effective_rank < 1 else _is_count(self.rank_step)
        self.require("rank_step", self.rank_step == 0 or same_kind,
                     f"must be 0 or, as osf_effective_rank {self.effective_rank!r} is, "
                     f"{'a fraction in (0, 1)' if self.effective_rank < 1 else 'a whole number >= 1'}")

    def preserved(self, task_index: int) -> Union[float, int]:
        """k_t as PEFT's `effective_rank` takes it: r_0 + t·Δ, a fraction (float) or a count (int)."""
        value = round(self.effective_rank + task_index * self.rank_step, 12)  # 0.3 + 3·0.2 is 0.9, not 0.90…01
        return value if self.effective_rank < 1 else int(value)


def preserved_rank(value: Union[float, int], shape) -> int:
    """The directions of a weight of `shape` that `value` preserves, by PEFT's rule: ⌊f·d⌋ for a
    fraction f, else the count (at most d), with d = min(shape)."""
    d = min(shape)
    return int(d * value) if isinstance(value, float) else min(d, value)


@register
class Osf(Method):
    name = "osf"
    config_class = OsfMethodConfig
    description = "OSF (PEFT): trains each projection's low singular subspace, the top one frozen, growing per task"
    single_domain = False
    sequence = True
    shardable = False  # the SVD, the gradient projection and the merge need each projection's whole weight
    trains_every_weight = True  # each projection's whole weight is a parameter (its update projected)

    def __init__(self, config):
        super().__init__(config)
        self.peft_model = None

    def check(self, model):
        """PEFT's OSF wraps torch.nn.Linear layers only (a fused expert tensor or a quantized layer is not one)."""
        targets = set(target_modules(model))
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in targets:
                continue
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight is None or not weight.is_floating_point():
                raise MethodError(f"osf: {name} ({type(module).__name__}, "
                                  f"{'no weight' if weight is None else weight.dtype}): PEFT's OSF adapts "
                                  f"torch.nn.Linear layers with floating-point weights only")

    def ranks(self, model, task_index: int) -> Dict[str, tuple]:
        """{projection: (k_t, d)} for task `task_index`; MethodError when a projection would keep
        no direction (PEFT refuses k = 0) or every one (nothing would train)."""
        value = self.config.preserved(task_index)
        targets = set(target_modules(model))
        ranks = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in targets:
                k, d = preserved_rank(value, module.weight.shape), min(module.weight.shape)
                if k < 1:
                    raise MethodError(f"osf: task {task_index + 1} preserves {value} of {name}'s {d} singular "
                                      f"directions, which is none; PEFT's OSF needs at least one: raise "
                                      f"osf_effective_rank")
                if k >= d:
                    raise MethodError(f"osf: task {task_index + 1} would preserve all {d} singular directions of "
                                      f"{name} (osf_effective_rank + {task_index} x osf_rank_step = {value}), "
                                      f"leaving nothing to train; for T tasks keep osf_effective_rank + (T - 1) x "
                                      f"osf_rank_step below 1 (fractions) or below the smallest projection's "
                                      f"dimension (counts)")
                ranks[name] = (k, d)
        return ranks

    def prepare(self, model, ctx, layers=None) -> Setup:
        from peft import OSFConfig, get_peft_model

        ranks = self.ranks(model, ctx.task_index)
        value = self.config.preserved(ctx.task_index)
        targets = target_modules(model)
        self.peft_model = get_peft_model(model, OSFConfig(target_modules=targets, effective_rank=value))
        trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        kept = sum(k for k, _ in ranks.values()) / sum(d for _, d in ranks.values())
        return Setup(trainable, self.groups(trainable, ctx), [],
                     f"trains OSF's low singular subspace of {', '.join(targets)} (preserved rank {value}: "
                     f"{kept:.0%} of the directions frozen)")

    def end_task(self, model, out, report: Dict):
        """Merge the task's change into the weights (PEFT's `merge_and_unload`): a plain model again."""
        report["osf_effective_rank"] = self.peft_model.peft_config["default"].effective_rank
        merged = self.peft_model.merge_and_unload()
        self.peft_model = None
        return super().end_task(merged, out, report)
