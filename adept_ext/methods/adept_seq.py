"""ADEPT and LLaMA-Pro over a task sequence (docs/methods.md §1, §5): for every task k new function-preserving
copies are inserted — after the k original layers whose bypass raises the general probe loss
least (`adept_seq`, then trained with ADEPT's per-unit rates among the new copies' units) or
after LLaMA-Pro's uniformly spaced original layers (`llama_pro_seq`, one learning rate) — and
only the new copies train: the originals and the earlier tasks' copies stay frozen, so what an
earlier task learned is kept bit for bit.
"""
from typing import List

from ..expand import expand_layers
from ..lr import param_groups
from ..models import adapter
from ..placement import uniform
from ..probe import layer_importance
from ..units import UnitImportance
from .adept import DecoupledRates, LayerMethod, describe_copies
from .base import MethodError, Setup, register, train_only


def original_layers(model) -> List[int]:
    """Indices (current numbering) of the layers that are not copies made by an expansion."""
    copies = set((getattr(model.config, "adept", None) or {}).get("expanded_layers", []))
    return [i for i in range(adapter(model).num_layers) if i not in copies]


class ExpandPerTask(LayerMethod):
    """Insert k new copies per task (after original layers only) and train only those."""

    single_domain = False
    sequence = True

    def pick(self, model, ctx, originals: List[int]) -> List[int]:
        raise NotImplementedError

    def prepare(self, model, ctx, layers=None) -> Setup:
        originals = original_layers(model)
        if not 0 < self.cfg.k <= len(originals):
            raise MethodError(f"k = {self.cfg.k} is not in [1, {len(originals)}] original layers")
        self.chosen = list(layers) if layers is not None else self.pick(model, ctx, originals)
        before = set(id(layer) for layer in adapter(model).layers)
        expand_layers(model, self.chosen)
        new = [i for i, layer in enumerate(adapter(model).layers) if id(layer) not in before]
        trainable = train_only(model, (p for i in new for p in adapter(model).layers[i].parameters()))
        self.new_copies = new
        return Setup(trainable, self.groups_for(model, ctx, trainable), list(self.chosen),
                     f"trains {len(new)} new {describe_copies(self.chosen)}; earlier copies frozen")

    def groups_for(self, model, ctx, trainable):
        return self.groups(trainable)


@register
class AdeptSeq(DecoupledRates, ExpandPerTask):
    name = "adept_seq"
    description = "ADEPT per task: copies of the k least important original layers, per-unit rates on the new copies"

    def pick(self, model, ctx, originals):
        self.scores = layer_importance(model, ctx.general_probe, progress=ctx.progress)
        return sorted(sorted(originals, key=lambda i: (self.scores.scores[i], i))[:self.cfg.k])

    def groups_for(self, model, ctx, trainable):
        """Per-unit groups and importance over the new copies' units only."""
        importance = UnitImportance(model, ctx.general_probe, normalize=self.cfg.normalize,
                                    autocast_dtype=ctx.autocast_dtype)
        importance.units = [u for u in importance.units if u.layer in self.new_copies]
        self.importance = importance
        names = {u.name for u in importance.units}
        return [g for g in param_groups(model, self.cfg.lr, self.cfg.weight_decay) if g["adept_unit"] in names]


@register
class LlamaProSeq(ExpandPerTask):
    name = "llama_pro_seq"
    description = "LLaMA-Pro per task: k uniformly spaced copies of original layers, one learning rate"

    def pick(self, model, ctx, originals):
        return sorted(originals[j] for j in uniform(len(originals), self.cfg.k))
