"""LLaMA-Pro (Wu et al., ACL 2024; ADEPT's main baseline, docs/methods.md §1.4): k function-preserving copies
spaced uniformly through the depth — after layers round((i+1)·L/k) − 1, i = 0..k−1 — trained at
one learning rate."""
from dataclasses import dataclass
from typing import ClassVar, List

from ..models import adapter
from ..adept.placement import uniform
from .adept import ExpandMethod, LayerConfig
from .base import register


@dataclass(kw_only=True)
class LlamaProConfig(LayerConfig):
    """k uniformly spaced copies (or copies of `layers`)."""

    method: ClassVar[str] = "llama_pro"


@register
class LlamaPro(ExpandMethod):
    name = "llama_pro"
    config_class = LlamaProConfig
    description = "LLaMA-Pro: k copies spaced uniformly through the depth, one learning rate"

    def choose(self, model, ctx) -> List[int]:
        return uniform(adapter(model).num_layers, self.config.k)
