"""Ablation of ADEPT (docs/methods.md §1.4): Stage 1 as ADEPT (the same copies), but every unit of the
copies trains at the one base learning rate — no Stage 2 decoupled rates."""
from dataclasses import dataclass
from typing import ClassVar

from .adept import ExpandMethod, PlacementConfig
from .base import register


@dataclass(kw_only=True)
class AdeptUniformLrConfig(PlacementConfig):
    """ADEPT's Stage 1 options (k or layers, placement, boundary); no rates to configure."""

    method: ClassVar[str] = "adept_uniform_lr"


@register
class AdeptUniformLR(ExpandMethod):
    name = "adept_uniform_lr"
    config_class = AdeptUniformLrConfig
    description = "ADEPT's copies trained at one learning rate (ablation of Stage 2)"
