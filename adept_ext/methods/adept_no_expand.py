"""Ablation of ADEPT (docs/methods.md §1.4): no expansion — the k least important layers themselves are
trained (everything else frozen) with ADEPT's per-unit rates. The saved model has no
`config.adept` block (nothing was expanded)."""
from dataclasses import dataclass
from typing import ClassVar, Dict

from ..models import adapter
from .adept import AdeptConfig, DecoupledRates, LayerMethod
from .base import Setup, register, train_only


@dataclass(kw_only=True)
class AdeptNoExpandConfig(AdeptConfig):
    """ADEPT's options; the k chosen layers themselves train."""

    method: ClassVar[str] = "adept_no_expand"


@register
class AdeptNoExpand(DecoupledRates, LayerMethod):
    name = "adept_no_expand"
    config_class = AdeptNoExpandConfig
    description = "ADEPT's per-unit rates on the k least important layers themselves (no copies)"
    selected_label = "trained"

    def prepare(self, model, ctx, layers=None) -> Setup:
        layers = self.choose_layers(model, ctx, layers)
        # The units of Stage 2 are read from config.adept: the trained layers stand in for copies.
        model.config.adept = {"expanded_layers": list(layers), "source_layers": list(layers)}
        ad = adapter(model)
        trainable = train_only(model, (p for l in layers for p in ad.layers[l].parameters()))
        return Setup(trainable, self.groups_for(model, ctx, trainable), list(layers), f"trains layers {layers}")

    def end_task(self, model, out, report: Dict):
        model = super().end_task(model, out, report)
        del model.config.adept  # nothing was expanded
        return model
