"""Ablation of ADEPT (docs/methods.md §1.4): Stage 1 as ADEPT (the same copies), but every unit of the
copies trains at the one base learning rate — no Stage 2 decoupled rates."""
from .adept import ExpandMethod
from .base import register


@register
class AdeptUniformLR(ExpandMethod):
    name = "adept_uniform_lr"
    description = "ADEPT's copies trained at one learning rate (ablation of Stage 2)"
