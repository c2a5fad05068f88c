"""ADEPT and LLaMA-Pro over a task sequence (docs/methods.md §1, §5): for every task k new function-preserving
copies are inserted — after the k original layers whose bypass raises the general probe loss
least (`adept_seq`, then trained with ADEPT's per-unit rates among the new copies' units) or
after LLaMA-Pro's uniformly spaced original layers (`llama_pro_seq`, one learning rate) — and
only the new copies train: the originals and the earlier tasks' copies stay frozen, so what an
earlier task learned is kept bit for bit.
"""
from dataclasses import dataclass
from typing import ClassVar, List

from ..adept.expand import expand_layers
from ..models import adapter
from ..adept.placement import uniform
from ..adept.probe import layer_importance
from .adept import DecoupledRates, LayerMethod, RatesConfig, check_k, describe_copies
from .base import MethodConfig, MethodError, Setup, option, register, train_only


@dataclass(kw_only=True)
class CopiesPerTaskConfig(MethodConfig):
    """k new copies per task."""

    k: int = option(2, help="number of new layer copies per task")

    def __post_init__(self):
        super().__post_init__()
        self.require("k", self.k >= 1, "must be >= 1")


@dataclass(kw_only=True)
class AdeptSeqConfig(RatesConfig, CopiesPerTaskConfig):
    """k copies per task, and Stage 2's rates over the new copies."""

    method: ClassVar[str] = "adept_seq"


@dataclass(kw_only=True)
class LlamaProSeqConfig(CopiesPerTaskConfig):
    method: ClassVar[str] = "llama_pro_seq"


def original_layers(model) -> List[int]:
    """Indices (current numbering) of the layers that are not copies made by an expansion."""
    copies = set((getattr(model.config, "adept", None) or {}).get("expanded_layers", []))
    return [i for i in range(adapter(model).num_layers) if i not in copies]


class ExpandPerTask(LayerMethod):
    """Insert k new copies per task (after original layers only) and train only those."""

    single_domain = False
    sequence = True

    def check(self, model):
        check_k(self.config.k, adapter(model).num_layers)

    def pick(self, model, ctx, originals: List[int]) -> List[int]:
        raise NotImplementedError

    def prepare(self, model, ctx, layers=None) -> Setup:
        originals = original_layers(model)
        if not 0 < self.config.k <= len(originals):
            raise MethodError(f"k = {self.config.k} is not in [1, {len(originals)}] original layers")
        self.chosen = list(layers) if layers is not None else self.pick(model, ctx, originals)
        before = set(id(layer) for layer in adapter(model).layers)
        expand_layers(model, self.chosen)
        new = [i for i, layer in enumerate(adapter(model).layers) if id(layer) not in before]
        trainable = train_only(model, (p for i in new for p in adapter(model).layers[i].parameters()))
        self.new_copies = new
        return Setup(trainable, self.groups_for(model, ctx, trainable), list(self.chosen),
                     f"trains {len(new)} new {describe_copies(self.chosen)}; earlier copies frozen")

    def groups_for(self, model, ctx, trainable):
        return self.groups(trainable, ctx)


@register
class AdeptSeq(DecoupledRates, ExpandPerTask):
    name = "adept_seq"
    config_class = AdeptSeqConfig
    description = "ADEPT per task: copies of the k least important original layers, per-unit rates on the new copies"

    def pick(self, model, ctx, originals):
        self.scores = layer_importance(model, ctx.general_probe, progress=ctx.progress)
        return sorted(sorted(originals, key=lambda i: (self.scores.scores[i], i))[:self.config.k])

    def groups_for(self, model, ctx, trainable):
        """Per-unit groups and importance over the new copies' units only."""
        return super().groups_for(model, ctx, trainable, self.new_copies)


@register
class LlamaProSeq(ExpandPerTask):
    name = "llama_pro_seq"
    config_class = LlamaProSeqConfig
    description = "LLaMA-Pro per task: k uniformly spaced copies of original layers, one learning rate"

    def pick(self, model, ctx, originals):
        return sorted(originals[j] for j in uniform(len(originals), self.config.k))
