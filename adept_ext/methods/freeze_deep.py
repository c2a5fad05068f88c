"""LayerTracer's allocation (arXiv 2605.11416, docs/methods.md §3): train the shallow layers [0, b) and
freeze the deep ones, with b = half the depth, a number, or `auto` — from a LayerTracer diagnosis
of the model (task particle and context sensitivity, see `lens.allocate`)."""
from dataclasses import dataclass
from typing import ClassVar

from ..lens import allocate, diagnose
from ..models import adapter
from .adept import BoundaryConfig
from .base import Method, MethodError, Setup, register, train_only

DIAGNOSIS_TASKS = ("bbc-topic", "context")  # the runner's LayerTracer inputs (named in the diagnosis plot)


@dataclass(kw_only=True)
class FreezeDeepConfig(BoundaryConfig):
    """The boundary b, and which diagnosis inputs the runner gives an `auto` boundary (for the plot's title)."""

    method: ClassVar[str] = "freeze_deep"
    diagnosis_task: str = "bbc-topic"

    def __post_init__(self):
        super().__post_init__()
        self.require_one_of("diagnosis_task", DIAGNOSIS_TASKS)


@register
class FreezeDeep(Method):
    name = "freeze_deep"
    config_class = FreezeDeepConfig
    description = "LayerTracer: train the shallow layers [0, b), freeze the deep ones"

    def __init__(self, config):
        super().__init__(config)
        self.diagnosis = None

    def check(self, model):
        n, boundary = adapter(model).num_layers, self.config.boundary
        if boundary.isdigit() and not 1 <= int(boundary) <= n - 1:
            raise MethodError(f"boundary {boundary} is not in [1, {n - 1}] for a model with {n} layers")

    def prepare(self, model, ctx, layers=None) -> Setup:
        ad = adapter(model)
        if self.config.boundary == "auto":
            try:
                self.diagnosis = diagnose(model, ctx.diagnosis_batches(), None, progress=ctx.progress)
            except (FileNotFoundError, ValueError) as e:
                raise MethodError(f"diagnosis: {e}") from e
        boundary = int(self.config.boundary) if self.config.boundary.isdigit() else None
        layers = allocate(ad.num_layers, "freeze_deep", self.diagnosis, boundary)
        trainable = train_only(model, (p for l in layers for p in ad.layers[l].parameters()))
        return Setup(trainable, self.groups(trainable, ctx), layers, f"trains layers [0, {len(layers)})")

    def write_artifacts(self, out):
        if self.diagnosis is not None:
            self.diagnosis.to_json(out / "diagnosis.json")
            self.diagnosis.plot(out / "diagnosis.png", f"LayerTracer diagnosis ({self.config.diagnosis_task})")
