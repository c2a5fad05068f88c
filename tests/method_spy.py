"""A spy on the training engine for the end-to-end method tests (test_continual.py, test_train.py):
what each task of a run trained and how, so that every method's test can assert the effect that
is its own (and a method that does nothing fails it)."""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import adept_ext.training.loop as loop
from adept_ext.methods.task import Task


@dataclass
class TaskRecord:
    """One task of a run: its method, the trainable parameters as prepared and as trained, the
    parameters that do not train (names and values as prepared), the learning rate of every
    param group at every optimizer step (as the step ran: after the method's step pre-hooks),
    the value of every penalty term the method added, the training blocks it chose, and what the
    test's `at_finish` noted."""

    method: Any
    task: Task
    names: List[str]  # the trainable parameters' names in the prepared model
    before: List[torch.Tensor]
    frozen: Dict[str, torch.Tensor]
    after: Optional[List[torch.Tensor]] = None
    frozen_changed: Optional[List[str]] = None
    step_lrs: List[List[float]] = field(default_factory=list)
    penalties: List[List[float]] = field(default_factory=list)
    blocks: Any = None  # (every task's training blocks, the blocks the method chose for this task)
    notes: Dict[str, Any] = field(default_factory=dict)

    def delta(self) -> List[torch.Tensor]:
        """The trainable parameters' change over the task's steps."""
        return [a - b for a, b in zip(self.after, self.before)]

    def unchanged(self) -> List[int]:
        """Indices of the trainable parameters that the task's steps left bit-equal."""
        return [i for i, (a, b) in enumerate(zip(self.after, self.before)) if torch.equal(a, b)]

    def layers(self) -> List[int]:
        """The decoder layers (numbering of the prepared model) that hold trainable parameters."""
        return sorted({int(n.split(".")[2]) for n in self.names if n.startswith("model.layers.")})


def changed_tensors(model, base) -> List[str]:
    """Names of the state-dict entries of `model` that differ from `base`'s."""
    reference = base.state_dict()
    return [n for n, t in model.state_dict().items() if not torch.equal(t, reference[n])]


class TaskSpy:
    """Installs itself with `monkeypatch` on `adept_ext.training.loop` (prepare, optimizer_for)
    and `Task.finish`; `tasks` holds a `TaskRecord` per task, in order. `at_finish(record)`, if
    set, runs when a task's steps are done, before the method's `end_task` (hooks still attached,
    adapters not merged)."""

    def __init__(self, monkeypatch):
        self.tasks: List[TaskRecord] = []
        self.at_finish: Optional[Callable[[TaskRecord], None]] = None
        real_prepare, real_optimizer_for, real_finish = loop.prepare, loop.optimizer_for, Task.finish

        def prepare(model, method, **kwargs):
            self._instrument(method)
            task = real_prepare(model, method, **kwargs)
            trainable = {id(p) for p in task.trainable}
            names = [n for n, p in model.named_parameters() if id(p) in trainable]
            frozen = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in trainable}
            self.tasks.append(TaskRecord(method, task, names, [p.detach().clone() for p in task.trainable], frozen))
            return task

        def optimizer_for(task, cfg):
            optimizer, scheduler = real_optimizer_for(task, cfg)  # the method's hooks are attached first
            record = self.tasks[-1]
            optimizer.register_step_pre_hook(
                lambda opt, *_: record.step_lrs.append([g["lr"] for g in opt.param_groups]))
            return optimizer, scheduler

        def finish(task, out=None, report=None):
            record = next(r for r in self.tasks if r.task is task)
            record.after = [p.detach().clone() for p in task.trainable]
            params = dict(task.model.named_parameters())
            record.frozen_changed = [n for n, v in record.frozen.items()
                                     if n in params and not torch.equal(params[n], v)]
            if self.at_finish is not None:
                self.at_finish(record)
            return real_finish(task, out, report)

        monkeypatch.setattr(loop, "prepare", prepare)
        monkeypatch.setattr(loop, "optimizer_for", optimizer_for)
        monkeypatch.setattr(Task, "finish", finish)

    def _instrument(self, method):
        """Record the method's penalties and training blocks (once per method object)."""
        if getattr(method, "_spied", False):
            return
        method._spied = True
        penalties, train_blocks = method.penalties, method.train_blocks

        def recording_penalties(model):
            terms = penalties(model)
            self.tasks[-1].penalties.append([float(t.detach()) for t in terms])
            return terms

        def recording_train_blocks(blocks, task_index):
            chosen = train_blocks(blocks, task_index)
            self.tasks[-1].blocks = (blocks, chosen)
            return chosen

        method.penalties, method.train_blocks = recording_penalties, recording_train_blocks
