"""ADEPT (arXiv 2510.10071, docs/methods.md §1): Stage 1 probes every decoder layer on the general corpus
(loss increase when bypassed, §1.1) and duplicates the k least important ones right after their
sources with function-preserving init, freezing the originals (§1.2); Stage 2 trains the copies
with per-unit learning rates lr_U = 2·(1 − Î_U)·lr from first-order Taylor importance
Î_U ∝ mean |θ·∇θ| on the general probe, recomputed every `recompute_every` steps (§1.3).
A model that is already expanded (`config.adept`) keeps and trains its copies.
"""
import json
from typing import Dict, List, Optional

from .. import placement
from ..expand import expand_layers
from ..lens import boundary_from, diagnose
from ..lr import DecoupledLR, param_groups
from ..models import adapter
from ..report import plot_unit_rates
from ..units import UnitImportance
from .base import Context, Method, MethodError, Setup, register


def explicit_layers(cfg) -> Optional[List[int]]:
    """The --layers choice as sorted distinct indices, or None when the method chooses."""
    if not getattr(cfg, "layers", ""):
        return None
    try:
        return sorted({int(x) for x in cfg.layers.split(",")})
    except ValueError:
        raise MethodError(f"--layers must be comma-separated layer indices, got {cfg.layers!r}") from None


def copy_positions(sources: List[int]) -> List[int]:
    """Where the copies of `sources` (original numbering) sit in the expanded model."""
    return [s + 1 + i for i, s in enumerate(sorted(sources))]


def describe_copies(sources: List[int]) -> str:
    return f"copies of layers {sorted(sources)} (layers {copy_positions(sources)} of the expanded model)"


class LayerMethod(Method):
    """A method that expands or trains k layers: ADEPT's probe choice, or the layers of --layers."""

    takes_layers = True
    selected_label = "copied (their copies train)"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scores = None     # LayerScores of the Stage 1 probe (general corpus), when one ran
        self.placement = None  # what the placement criterion measured, when one ran
        self.chosen: List[int] = []

    def check(self, model):
        n = adapter(model).num_layers
        if not 0 < self.cfg.k <= n:
            raise MethodError(f"k = {self.cfg.k} is not in [1, {n}] for a model with {n} layers")
        bad = [l for l in explicit_layers(self.cfg) or [] if not 0 <= l < n]
        if bad:
            raise MethodError(f"--layers {bad} out of range for a model with {n} layers")

    def choose(self, model, ctx: Context) -> List[int]:
        """Stage 1 by `cfg.placement` (see `adept_ext.placement`; default: ADEPT's importance,
        the k layers whose bypass raises the general probe loss least)."""
        name = getattr(self.cfg, "placement", "importance")
        boundary = None
        if name == "depth" and self.cfg.boundary.isdigit():
            boundary = int(self.cfg.boundary)
        elif name == "depth" and self.cfg.boundary == "auto":
            boundary = boundary_from(diagnose(model, ctx.diagnosis_batches(), None, progress=ctx.progress))
        try:
            result = placement.choose(name, model, self.cfg.k, ctx.general_probe, ctx.domain_probe, boundary,
                                      ctx.progress)
        except ValueError as e:
            raise MethodError(f"--placement {name}: {e}") from e
        self.scores = result.pop("general")
        self.placement = {"placement": name, "boundary": boundary, **result}
        return result["layers"]

    def choose_layers(self, model, ctx: Context, layers: Optional[List[int]]) -> List[int]:
        """`layers` (a replayed choice), else --layers, else the method's own choice."""
        if layers is None:
            layers = explicit_layers(self.cfg)
        self.chosen = list(layers) if layers is not None else self.choose(model, ctx)
        return self.chosen

    def write_artifacts(self, out):
        if self.scores is not None:
            self.scores.to_json(out / "layer_importance.json", selected=self.chosen)
            self.scores.plot(out / "layer_importance.png", label=self.selected_label)
        if self.placement is not None:
            (out / "placement.json").write_text(json.dumps(self.placement, indent=2))


class DecoupledRates:
    """Stage 2 (docs/methods.md §1.3) as a mixin: one param group per unit and `DecoupledLR` on the optimizer."""

    def groups_for(self, model, ctx: Context, trainable) -> List[Dict]:
        self.importance = UnitImportance(model, ctx.general_probe, normalize=self.cfg.normalize,
                                         autocast_dtype=ctx.autocast_dtype)
        return param_groups(model, self.cfg.lr, self.cfg.weight_decay)

    decoupled = None

    def attach(self, optimizer):
        self.decoupled = DecoupledLR(optimizer, self.importance, every=self.cfg.recompute_every,
                                     last_step=self.cfg.steps)

    def step_note(self) -> str:
        due = self.decoupled is not None and self.decoupled.recompute_due()
        return "recomputing unit importance" if due else ""

    def end_task(self, model, out, report: Dict):
        self.decoupled.remove()
        units, multipliers = self.importance.units, self.decoupled.multipliers
        report["unit_rates"] = {"multipliers": dict(zip([u.name for u in units], multipliers)),
                                "mean_multiplier": self.decoupled.mean_multiplier,
                                "recomputes": self.decoupled.recomputes}
        if out is not None:  # None on the ranks that write nothing
            plot_unit_rates(units, multipliers, out / "unit_rates.png")
        self.decoupled = None
        return super().end_task(model, out, report)

    def state_dict(self) -> Dict:
        """The rates' state while attached to a task's optimizer (nothing between tasks)."""
        return {"decoupled": self.decoupled.state_dict()} if self.decoupled is not None else {}

    def load_state_dict(self, state: Dict):
        if "decoupled" in state:
            self.decoupled.load_state_dict(state["decoupled"])


class ExpandMethod(LayerMethod):
    """Insert a function-preserving copy after each chosen layer and train only the copies. A model
    that already has copies (config.adept) trains those instead."""

    def groups_for(self, model, ctx: Context, trainable) -> List[Dict]:
        return self.groups(trainable)

    def prepare(self, model, ctx: Context, layers=None) -> Setup:
        existing = getattr(model.config, "adept", None) or {}
        if existing.get("expanded_layers"):
            copies = list(existing["expanded_layers"])
            self.chosen = [s - sum(c < s for c in copies) for s in existing["source_layers"]]
            trainable = expand_layers(model, [])
        else:
            trainable = expand_layers(model, self.choose_layers(model, ctx, layers))
        return Setup(trainable, self.groups_for(model, ctx, trainable), list(self.chosen),
                     f"trains {len(self.chosen)} {describe_copies(self.chosen)}")


@register
class Adept(DecoupledRates, ExpandMethod):
    name = "adept"
    description = "ADEPT: copies of the k least important layers (general probe), per-unit learning rates"
