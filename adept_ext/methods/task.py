"""One call that readies a model for a task with any method, for a user's own training loop
(and the runners' `training.fit_task`, which calls it too):

    method = get_method(OLoraConfig(lam=0.5))
    task = prepare(model, method, general_probe=probe, lr=3e-4, total_steps=len(loader))
    optimizer = torch.optim.AdamW(task.param_groups); task.attach(optimizer)
    for batch in task.batches(loader):
        task.loss(batch).backward(); optimizer.step(); optimizer.zero_grad()
    model = task.finish()  # hooks off, adapters merged: a plain Hugging Face model
    model.save_pretrained(folder)  # everything the task learned (DEAL public_code: its adapter beside the weights)

A model is prepared for one task at a time: `prepare` marks it (`PREPARED`) and `finish` clears
the mark, so a second `prepare` before `finish` is refused; the finished model is prepared for
the next task of a sequence as usual.
"""
import logging
import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

from ..errors import InputError
from ..lm_loss import uses_fused_loss
from .base import Context, Method, Setup

logger = logging.getLogger(__name__)

PREPARED = "adept_ext_prepared"  # attribute of a model prepared for a task and not finished yet: the method's name


class Task:
    """A method prepared on a model for one task: its param groups, optimizer hooks, loss and finish."""

    def __init__(self, model, method: Method, setup: Setup, loss_implementation: str = "auto"):
        self.model, self.method, self.setup = model, method, setup
        self.loss_implementation = loss_implementation
        self.finished = False

    @property
    def param_groups(self) -> List[Dict]:
        """The optimizer param groups (each with its lr and weight decay: ADEPT has one per unit)."""
        return self.setup.groups

    @property
    def trainable(self) -> List[torch.nn.Parameter]:
        return self.setup.trainable

    @property
    def layers(self) -> List[int]:
        """Layers expanded or trained (numbering of the model before the task)."""
        return self.setup.layers

    @property
    def summary(self) -> str:
        return self.setup.summary

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def attach(self, optimizer):
        """Install the method's optimizer-step hooks (ADEPT: per-unit rates; EoupCT: projection)."""
        self.method.attach(optimizer)

    def batch_on_device(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The tensors of `batch` on the model's device (one already there is taken as it is)."""
        device = self.device
        return {k: v.to(device) for k, v in batch.items()}

    def batches(self, loader: Iterable[Dict[str, torch.Tensor]]):
        """The batches of `loader` on the model's device."""
        for batch in loader:
            yield self.batch_on_device(batch)

    def loss(self, batch: Dict[str, torch.Tensor], model=None, num_items=None,
             micro_batches: int = 1) -> torch.Tensor:
        """The method's training loss of one micro-batch (the task loss, fused unless the head needs
        Hugging Face's, plus its penalty, if any); `model`: the module to run when it is wrapped
        (DDP), else the prepared model. For gradient accumulation pass `num_items`, the labelled
        tokens of the optimizer step (`lm_loss.labelled_tokens` over its micro-batches), and
        `micro_batches`, their number: the step's losses then sum to its mean over every labelled token."""
        return self.method.loss(self.model if model is None else model, self.batch_on_device(batch),
                                self.loss_implementation, num_items, micro_batches)

    def step_note(self) -> str:
        """What the next optimizer step does besides updating (for a progress bar), or ""."""
        return self.method.step_note()

    def metrics(self) -> Dict[str, float]:
        """The method's own statistics for live tracking (ADEPT: the rates' mean multiplier)."""
        return self.method.metrics()

    def finish(self, out=None, report: Optional[Dict] = None):
        """End the task: hooks off, adapters merged, plots into `out` (None: none), report entries
        into `report`; returns the Hugging Face model to evaluate and save: its `save_pretrained`
        saves everything the task learned (DEAL's public_code variant, not mergeable: the base
        weights and, beside them, the adapter its forward hooks apply; `deal.load_adapter` puts
        it back on the reloaded model). The model may then be prepared for a next task."""
        if self.finished:
            raise InputError("this task is finished already: finish() ends a task once; prepare the model it "
                             "returned for a next task")
        prepared = self.model
        self.model = self.method.end_task(prepared, out, {} if report is None else report)
        self.finished = True
        for model in (prepared, self.model):
            vars(model).pop(PREPARED, None)
        return self.model

    def state_dict(self) -> Dict:
        return self.method.state_dict()

    def load_state_dict(self, state: Dict):
        self.method.load_state_dict(state)


def prepare(model, method: Method, *, lr: float, total_steps: int, general_probe: Sequence = (),
            domain_probe: Sequence = (), weight_decay: float = 0.01, seed: int = 0, task_index: int = 0,
            autocast_dtype: Optional[torch.dtype] = None,
            diagnosis_batches: Optional[Callable[[], List[Dict[str, torch.Tensor]]]] = None,
            layers: Optional[List[int]] = None, loss_implementation: str = "auto", progress: bool = True,
            log: Callable = logger.info) -> Task:
    """Check `method` against `model`, then prepare it for one task (freeze, expand, wrap, score
    units: whatever the method does) and return the `Task`. `general_probe`: general-domain
    batches (ADEPT's probe and unit importance); `domain_probe`: the task's (placements);
    `task_index`: 0-based position in a sequence; `layers`: a layer choice to replay (resume);
    `loss_implementation`: auto | fused | hf (`lm_loss`). InputError before anything changes for
    impossible training settings, and for a model prepared for a task that was not finished."""
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise InputError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(total_steps, int) and total_steps >= 1):
        raise InputError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if not weight_decay >= 0:
        raise InputError(f"weight_decay must be >= 0, got {weight_decay!r}")
    earlier = getattr(model, PREPARED, None)
    if earlier is not None:
        raise InputError(f"this model is already prepared for a task ({earlier}) that was not finished: call "
                         f"finish() on that task first and prepare the model it returns (preparing twice would "
                         f"expand, wrap or hook the model again)")
    uses_fused_loss(model, loss_implementation)  # an unknown name, or fused on a head it cannot reproduce
    method.check(model)
    ctx = Context(general_probe, domain_probe, progress, autocast_dtype, task_index, diagnosis_batches, log,
                  lr=lr, weight_decay=weight_decay, total_steps=total_steps, seed=seed)
    task = Task(model, method, method.prepare(model, ctx, layers=layers), loss_implementation)
    setattr(model, PREPARED, method.name)
    return task
