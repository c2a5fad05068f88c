"""ADEPT Stage 2: decoupled per-unit learning rates (docs/methods.md §1.3).

Every unit U (one parameter tensor of an expanded layer) gets its own rate
lr_U = max(2·(1 − Î_U), floor) · lr, where lr is whatever the optimizer's group holds at that
step (so warmup/cosine/LambdaLR schedulers compose: the multiplier is applied only for the
duration of `optimizer.step()`, through step hooks, and the scheduler's value is restored
exactly afterwards). Î is recomputed every `every` optimizer steps on the probe batches.
Each unit has its own param group (`param_groups`), so each really gets its own rate.
"""
from typing import Dict, List, Optional

import torch

from .units import UnitImportance, check_autocast_dtype, partition


def param_groups(model, lr: float, weight_decay: float = 0.0, no_decay_kinds=("norm",)) -> List[Dict]:
    """One optimizer param group per unit of the expanded model (see `units.partition`),
    tagged with `"adept_unit"`; norms get no weight decay by default."""
    params = dict(model.named_parameters())
    return [{"params": [params[u.name]], "lr": lr, "adept_unit": u.name,
             "weight_decay": 0.0 if u.kind in no_decay_kinds else weight_decay} for u in partition(model)]


class DecoupledLR:
    """Per-unit learning-rate multipliers m_U = max(2·(1 − Î_U), floor), recomputed every
    `every` optimizer steps (docs/methods.md §1.3).

    optimizer: built from `param_groups(model, ...)` (one group per unit); importance: a
    `UnitImportance` on the probe batches. Until the first recompute the copies take the
    scores of their source layers' units (a fresh copy scores exactly 0). `mean_multiplier`
    reports the realised mean of m_U, to compare methods at equal mean learning rate.
    `autocast_dtype`: the precision of the scores' recomputes (see `UnitImportance`). "auto"
    (default): what the training uses — a forward pre-hook on the model notes the autocast dtype
    of its training-mode forwards, and each recompute runs under the last one noted (a training
    without autocast, or none seen yet: the importance's own setting, whose default is fp32).
    torch.bfloat16 / torch.float16: that autocast; torch.float32: no autocast; None: the
    importance's own setting.

    `hooks=True`: the multipliers are applied by step pre/post hooks of `optimizer`. With an
    optimizer wrapper whose step does not run the torch optimizer's hooks in one call (DeepSpeed,
    a step that may be skipped), pass `hooks=False` and call `step_begin()` before and
    `step_end()` after each real step (the recompute happens in `step_end`). If a step raises
    between the two, the next `step_begin` first restores the scheduler's rates, so the
    multipliers never compound; `restore()` does it at once.
    `last_step`: the training's final step, if known; no recompute after it (its scores would
    rate no step; one probe pass saved).
    Raises ValueError if a unit has no param group of its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, importance: UnitImportance, every: int = 100,
                 floor: float = 0.1, autocast_dtype="auto", hooks: bool = True, last_step: Optional[int] = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not 0 <= floor <= 2:
            raise ValueError(f"floor must be in [0, 2], got {floor}")
        self.optimizer, self.importance, self.every, self.floor = optimizer, importance, every, floor
        self.last_step = last_step
        follow = autocast_dtype == "auto"
        self.autocast_dtype = None if follow else check_autocast_dtype(autocast_dtype)
        by_unit = {g.get("adept_unit"): i for i, g in enumerate(optimizer.param_groups) if g.get("adept_unit")}
        names = [u.name for u in importance.units]
        missing = [n for n in names if n not in by_unit]
        if missing:
            raise ValueError(f"unit {missing[0]} has no param group of its own ({len(missing)} missing): "
                             "build the optimizer from adept_ext.adept.lr.param_groups(model, lr)")
        # Indices, not the group dicts: optimizer.load_state_dict replaces the dicts.
        self._group_index = [by_unit[n] for n in names]
        self.steps = 0
        self.recomputes = 0
        self.scores = importance.compute(use_source=True, autocast_dtype=self.autocast_dtype)
        self._saved: Optional[List[float]] = None
        self._handles = [optimizer.register_step_pre_hook(lambda *_: self.step_begin()),
                         optimizer.register_step_post_hook(lambda *_: self.step_end())] if hooks else []
        self.training_autocast_dtype = None  # "auto": the autocast dtype of the last training forward
        if follow:
            self._handles.append(importance.model.register_forward_pre_hook(self._note_autocast))

    def _note_autocast(self, module, args):
        if module.training:  # the importance's own probe forwards run in eval mode
            device_type = next(module.parameters()).device.type  # where the model is now
            self.training_autocast_dtype = (torch.get_autocast_dtype(device_type)
                                            if torch.is_autocast_enabled(device_type) else None)

    @property
    def multipliers(self) -> List[float]:
        return [max(2.0 * (1.0 - s), self.floor) for s in self.scores]

    @property
    def mean_multiplier(self) -> float:
        m = self.multipliers
        return sum(m) / len(m)

    @property
    def _groups(self) -> List[Dict]:
        return [self.optimizer.param_groups[i] for i in self._group_index]

    def rates(self) -> Dict[str, float]:
        """Current learning rate of every unit (the group's scheduled lr × its multiplier)."""
        return {u.name: g["lr"] * m for u, g, m in zip(self.importance.units, self._groups, self.multipliers)}

    def recompute_due(self) -> bool:
        """Whether `step_end` of the coming step recomputes the importance."""
        step = self.steps + 1
        return step % self.every == 0 and (self.last_step is None or step < self.last_step)

    def recompute(self):
        dtype = self.autocast_dtype if self.autocast_dtype is not None else self.training_autocast_dtype
        self.scores = self.importance.compute(autocast_dtype=dtype)
        self.recomputes += 1

    def restore(self):
        """Put back the rates the groups had before `step_begin` (no-op outside a step)."""
        if self._saved is not None:
            for g, lr in zip(self._groups, self._saved):
                g["lr"] = lr
            self._saved = None

    def step_begin(self):
        """Multiply every unit's rate for the coming step (after undoing a step that raised)."""
        self.restore()
        groups = self._groups
        self._saved = [g["lr"] for g in groups]
        for g, m in zip(groups, self.multipliers):
            g["lr"] = g["lr"] * m

    def step_end(self):
        """Restore the scheduler's rates; recompute the importance every `every` steps (not after `last_step`)."""
        self.restore()
        due = self.recompute_due()
        self.steps += 1
        if due:
            self.recompute()

    def remove(self):
        """Detach from the optimizer (its groups keep the scheduler's plain rates)."""
        self.restore()
        for h in self._handles:
            h.remove()

    def state_dict(self) -> Dict:
        return {"scores": list(self.scores), "steps": self.steps, "recomputes": self.recomputes,
                "every": self.every, "floor": self.floor, "last_step": self.last_step,
                "units": [u.name for u in self.importance.units]}

    def load_state_dict(self, state: Dict):
        names = [u.name for u in self.importance.units]
        if state["units"] != names:
            raise ValueError("the saved state belongs to a model with other expanded units")
        self.scores, self.steps, self.recomputes = list(state["scores"]), state["steps"], state["recomputes"]
        self.every, self.floor, self.last_step = state["every"], state["floor"], state.get("last_step")
