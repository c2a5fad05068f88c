"""ADEPT (arXiv 2510.10071, docs/methods.md §1): Stage 1 probes every decoder layer on the general corpus
(loss increase when bypassed, §1.1) and duplicates the k least important ones right after their
sources with function-preserving init, freezing the originals (§1.2); Stage 2 trains the copies
with per-unit learning rates lr_U = 2·(1 − Î_U)·lr from first-order Taylor importance
Î_U ∝ mean |θ·∇θ| on the general probe, recomputed every `recompute_every` steps (§1.3).
A model that is already expanded (`config.adept`) keeps and trains its copies.
"""
import json
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional

from ..adept import placement
from ..adept.expand import expand_layers
from ..lens import boundary_from, diagnose
from ..adept.lr import DecoupledLR, param_groups
from ..models import adapter
from ..report import plot_unit_rates
from ..adept.units import NORMALIZATIONS, UnitImportance
from .base import Context, Method, MethodConfig, MethodError, Setup, option, register


def parse_layers(text: str) -> Optional[List[int]]:
    """The --layers option ("7,14") as layer indices, None when it is empty (the method chooses)."""
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise MethodError(f"--layers must be comma-separated layer indices, got {text!r}") from None


@dataclass(kw_only=True)
class LayerConfig(MethodConfig):
    """k layers to expand or train; `layers` (sorted distinct indices) overrides the method's choice."""

    k: int = option(4, commands=("probe", "expand", "diagnose"),
                    help="number of layers to expand (adept_no_expand: to train)")
    layers: Optional[List[int]] = option(None, parse=parse_layers, flat="", help=(
        "comma-separated layers to expand or train instead of the method's choice (overrides k)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("k", self.k >= 1, "must be >= 1")
        if self.layers is not None:
            if not (isinstance(self.layers, (list, tuple)) and self.layers
                    and all(isinstance(l, int) and not isinstance(l, bool) for l in self.layers)):
                raise MethodError(f"layers must be a non-empty list of layer indices or None, got {self.layers!r}")
            self.layers = sorted(set(self.layers))


@dataclass(kw_only=True)
class BoundaryConfig(MethodConfig):
    """LayerTracer's boundary b between shallow and deep layers (docs/methods.md §3): half (the
    depth's half), auto (from a LayerTracer diagnosis of the model) or a layer count."""

    boundary: str = option("half", help=(
        "the boundary b between shallow and deep layers (freeze_deep trains layers [0, b); the depth placement puts "
        "the k layers below it): half, auto (from a LayerTracer diagnosis) or a number"))

    def __post_init__(self):
        super().__post_init__()
        self.require("boundary", isinstance(self.boundary, str)
                     and (self.boundary in ("half", "auto") or self.boundary.isdigit()),
                     "must be half, auto or a layer count")


@dataclass(kw_only=True)
class PlacementConfig(BoundaryConfig, LayerConfig):
    """Where Stage 1 puts the k layers: `placement` (see `adept_ext.adept.placement`); `boundary` is the
    depth placement's boundary (half: none, auto: from a LayerTracer diagnosis, or a layer count)."""

    placement: str = option("importance", help=(
        "where the k layers go: importance (ADEPT), uniform (LLaMA-Pro's spacing), domain_aware, plasticity, depth "
        "(below --boundary), spread (least important per depth block); see adept_ext/adept/placement.py"))

    def __post_init__(self):
        super().__post_init__()
        self.require_one_of("placement", placement.PLACEMENTS)


@dataclass(kw_only=True)
class RatesConfig(MethodConfig):
    """Stage 2's per-unit rates (docs/methods.md §1.3): the importance normalisation and how often
    (optimizer steps) it is recomputed."""

    normalize: str = option("rank", help=(
        "unit-importance normalisation of the per-unit rates: rank, per_kind or global"))
    recompute_every: int = option(20, help="recompute unit importance every N optimizer steps")

    def __post_init__(self):
        super().__post_init__()
        self.require_one_of("normalize", NORMALIZATIONS)
        self.require("recompute_every", self.recompute_every >= 1, "must be >= 1")


@dataclass(kw_only=True)
class AdeptConfig(RatesConfig, PlacementConfig):
    """ADEPT: k copies placed by Stage 1 (or `layers`), trained with Stage 2's per-unit rates."""

    method: ClassVar[str] = "adept"


def check_k(k: int, n: int):
    if not 0 < k <= n:
        raise MethodError(f"k = {k} is not in [1, {n}] for a model with {n} layers")


def copy_positions(sources: List[int]) -> List[int]:
    """Where the copies of `sources` (original numbering) sit in the expanded model."""
    return [s + 1 + i for i, s in enumerate(sorted(sources))]


def describe_copies(sources: List[int]) -> str:
    return f"copies of layers {sorted(sources)} (layers {copy_positions(sources)} of the expanded model)"


class LayerMethod(Method):
    """A method that expands or trains k layers: ADEPT's probe choice, or the layers of --layers."""

    takes_layers = True
    selected_label = "copied (their copies train)"

    def __init__(self, config):
        super().__init__(config)
        self.scores = None     # LayerScores of the Stage 1 probe (general corpus), when one ran
        self.placement = None  # what the placement criterion measured, when one ran
        self.chosen: List[int] = []

    def check(self, model):
        n = adapter(model).num_layers
        check_k(self.config.k, n)
        bad = [l for l in self.config.layers or [] if not 0 <= l < n]
        if bad:
            raise MethodError(f"--layers {bad} out of range for a model with {n} layers")

    def choose(self, model, ctx: Context) -> List[int]:
        """Stage 1 by `config.placement` (see `adept_ext.adept.placement`; default: ADEPT's importance,
        the k layers whose bypass raises the general probe loss least)."""
        name, boundary = self.config.placement, None
        if name == "depth" and self.config.boundary.isdigit():
            boundary = int(self.config.boundary)
        elif name == "depth" and self.config.boundary == "auto":
            boundary = boundary_from(diagnose(model, ctx.diagnosis_batches(), None, progress=ctx.progress))
        try:
            result = placement.choose(name, model, self.config.k, ctx.general_probe, ctx.domain_probe, boundary,
                                      ctx.progress)
        except ValueError as e:
            raise MethodError(f"--placement {name}: {e}") from e
        self.scores = result.pop("general")
        self.placement = {"placement": name, "boundary": boundary, **result}
        return result["layers"]

    def choose_layers(self, model, ctx: Context, layers: Optional[List[int]]) -> List[int]:
        """`layers` (a replayed choice), else the config's layers, else the method's own choice."""
        if layers is None:
            layers = self.config.layers
        self.chosen = list(layers) if layers is not None else self.choose(model, ctx)
        return self.chosen

    def write_artifacts(self, out):
        if self.scores is not None:
            self.scores.to_json(out / "layer_importance.json", selected=self.chosen)
            self.scores.plot(out / "layer_importance.png", label=self.selected_label)
        if self.placement is not None:
            (out / "placement.json").write_text(json.dumps(self.placement, indent=2))


class DecoupledRates:
    """Stage 2 (docs/methods.md §1.3) as a mixin: one param group per unit (at ctx.lr, ctx.weight_decay)
    and `DecoupledLR` on the optimizer, which recomputes no rate after the task's last step
    (ctx.total_steps, kept by `groups_for`)."""

    def groups_for(self, model, ctx: Context, trainable, layers: Optional[List[int]] = None) -> List[Dict]:
        """Per-unit groups and importance over the units of the copies at `layers` (None: every copy)."""
        importance = UnitImportance(model, ctx.general_probe, normalize=self.config.normalize,
                                    autocast_dtype=ctx.autocast_dtype)
        groups = param_groups(model, ctx.lr, ctx.weight_decay)
        if layers is not None:
            importance.units = [u for u in importance.units if u.layer in layers]
            names = {u.name for u in importance.units}
            groups = [g for g in groups if g["adept_unit"] in names]
        self.importance, self.total_steps = importance, ctx.total_steps
        return groups

    decoupled = None

    def attach(self, optimizer):
        self.decoupled = DecoupledLR(optimizer, self.importance, every=self.config.recompute_every,
                                     last_step=self.total_steps)

    def step_note(self) -> str:
        due = self.decoupled is not None and self.decoupled.recompute_due()
        return "recomputing unit importance" if due else ""

    def metrics(self) -> Dict[str, float]:
        """The per-unit rates' mean multiplier and how often the importance was recomputed."""
        if self.decoupled is None:
            return {}
        return {"adept/mean_lr_multiplier": self.decoupled.mean_multiplier,
                "adept/recomputes": self.decoupled.recomputes}

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
        return self.groups(trainable, ctx)

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
    config_class = AdeptConfig
    description = "ADEPT: copies of the k least important layers (general probe), per-unit learning rates"
