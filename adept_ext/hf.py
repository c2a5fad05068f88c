"""transformers.Trainer integration of ADEPT's decoupled learning rates (docs/methods.md §1.3)."""
import torch
from transformers import TrainerCallback

from .lr import DecoupledLR
from .units import UnitImportance


class ADEPTCallback(TrainerCallback):
    """Attaches `DecoupledLR` to the Trainer's optimizer when training starts, recomputes the
    unit importance every `every` optimizer steps, and logs the per-unit rates.

    The optimizer must have one param group per unit: pass
    ``optimizers=(torch.optim.AdamW(adept_ext.lr.param_groups(model, lr)), None)`` to the
    Trainer (it then builds its own scheduler on top, which composes with the multipliers).
    The recompute runs in the training's precision: under autocast bf16/fp16 when the Trainer's
    `args.bf16`/`args.fp16` is set (`autocast_dtype="auto"`, the default), or as given.
    The multipliers are applied by the Trainer's own `on_pre_optimizer_step`/`on_optimizer_step`
    events around its optimizer step (`DecoupledLR(hooks=False)`), not by the torch optimizer's
    step hooks, so an optimizer wrapper that never runs those hooks (DeepSpeed, FSDP's) works too.
    """

    def __init__(self, probe_batches, every: int = 100, mode: str = "abs", normalize: str = "rank",
                 floor: float = 0.1, autocast_dtype="auto"):
        self.probe_batches = list(probe_batches)
        self.every, self.mode, self.normalize, self.floor = every, mode, normalize, floor
        self.autocast_dtype = autocast_dtype
        self.decoupled = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        dtype = self.autocast_dtype
        if dtype == "auto":
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        importance = UnitImportance(model, self.probe_batches, mode=self.mode, normalize=self.normalize,
                                    autocast_dtype=dtype)
        self.decoupled = DecoupledLR(optimizer, importance, every=self.every, floor=self.floor,
                                     last_step=state.max_steps or None, hooks=False,
                                     autocast_dtype=None)  # the importance's, from args (accelerate wraps forward)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.decoupled.step_begin()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.decoupled.step_end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds the mean multiplier, the recompute count and every unit's current rate to the
        logged values and to the Trainer's saved log history."""
        if self.decoupled is None or logs is None:
            return
        extra = {"adept_mean_lr_multiplier": self.decoupled.mean_multiplier,
                 "adept_recomputes": self.decoupled.recomputes,
                 **{f"adept_lr/{name}": rate for name, rate in self.decoupled.rates().items()}}
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        if self.decoupled is not None:
            self.decoupled.remove()
