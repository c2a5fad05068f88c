"""Full-parameter continual pretraining: every weight trains (the forgetting-prone upper bound on
domain gain, docs/methods.md §1.4). `seq_full` is the same, task after task (docs/methods.md §5)."""
from dataclasses import dataclass
from typing import ClassVar

from .base import Method, MethodConfig, Setup, register, train_only


@dataclass(kw_only=True)
class FullConfig(MethodConfig):
    """No options: every parameter at the task's lr and weight decay."""

    method: ClassVar[str] = "full"


@dataclass(kw_only=True)
class SeqFullConfig(FullConfig):
    method: ClassVar[str] = "seq_full"


@register
class Full(Method):
    name = "full"
    config_class = FullConfig
    description = "full-parameter training"
    trains_every_weight = True

    def prepare(self, model, ctx, layers=None) -> Setup:
        trainable = train_only(model, model.parameters())
        return Setup(trainable, self.groups(trainable, ctx), [], "trains every parameter")


@register
class SeqFull(Full):
    name = "seq_full"
    config_class = SeqFullConfig
    description = "full-parameter training, task after task"
    single_domain = False
    sequence = True
