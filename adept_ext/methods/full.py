"""Full-parameter continual pretraining: every weight trains (the forgetting-prone upper bound on
domain gain, docs/methods.md §1.4). `seq_full` is the same, task after task (docs/methods.md §5)."""
from dataclasses import dataclass
from typing import ClassVar

from ..errors import MethodError
from ..models import adapter
from .base import Method, MethodConfig, Setup, option, register, train_only


@dataclass(kw_only=True)
class FullConfig(MethodConfig):
    """No options: every parameter at the task's lr and weight decay."""

    method: ClassVar[str] = "full"


@dataclass(kw_only=True)
class SeqFullConfig(FullConfig):
    """The bottom layers that do not train after the first task."""

    method: ClassVar[str] = "seq_full"
    freeze_bottom: int = option(0, "freeze_bottom", help=(
        "after the first task, the embeddings and the decoder layers below this one do not train: they keep what "
        "the first task left (Spurious Forgetting's freezing of the bottom layers; 0: every weight trains)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("freeze_bottom", self.freeze_bottom >= 0, "must be >= 0")


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

    def check(self, model):
        check_freeze_bottom(self.config.freeze_bottom, model)

    def prepare(self, model, ctx, layers=None) -> Setup:
        """Every parameter trains, less (from the second task on, --freeze-bottom k) the embeddings (and a
        head tied to them) and decoder layers 0 … k − 1."""
        if not (ctx.task_index and self.config.freeze_bottom):
            return super().prepare(model, ctx, layers)
        ad = adapter(model)
        frozen = {id(p) for module in (ad.embed_tokens, *ad.layers[:self.config.freeze_bottom])
                  for p in module.parameters()}
        trainable = train_only(model, [p for p in model.parameters() if id(p) not in frozen])
        return Setup(trainable, self.groups(trainable, ctx), [],
                     f"trains every parameter but the embeddings and layers below {self.config.freeze_bottom}")


def check_freeze_bottom(bottom: int, model):
    """MethodError where --freeze-bottom leaves no decoder layer to train after the first task."""
    if bottom >= adapter(model).num_layers:
        raise MethodError(f"freeze_bottom {bottom} leaves no layer of the model's {adapter(model).num_layers} to "
                          "train after the first task")
