"""Full-parameter continual pretraining: every weight trains (the forgetting-prone upper bound on
domain gain, docs/methods.md §1.4). `seq_full` is the same, task after task (docs/methods.md §5)."""
from .base import Method, Setup, register, train_only


@register
class Full(Method):
    name = "full"
    description = "full-parameter training"

    def prepare(self, model, ctx, layers=None) -> Setup:
        trainable = train_only(model, model.parameters())
        return Setup(trainable, self.groups(trainable), [], "trains every parameter")


@register
class SeqFull(Full):
    name = "seq_full"
    description = "full-parameter training, task after task"
    single_domain = False
    sequence = True
