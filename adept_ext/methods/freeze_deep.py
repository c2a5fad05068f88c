"""LayerTracer's allocation (arXiv 2605.11416, docs/methods.md §3): train the shallow layers [0, b) and
freeze the deep ones, with b = half the depth, a number, or `auto` — from a LayerTracer diagnosis
of the model (task particle and context sensitivity, see `lens.allocate`)."""
from ..lens import allocate, diagnose
from ..models import adapter
from .base import Method, MethodError, Setup, register, train_only


@register
class FreezeDeep(Method):
    name = "freeze_deep"
    description = "LayerTracer: train the shallow layers [0, b), freeze the deep ones"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.diagnosis = None

    def check(self, model):
        n = adapter(model).num_layers
        if self.cfg.boundary.isdigit() and not 1 <= int(self.cfg.boundary) <= n - 1:
            raise MethodError(f"boundary {self.cfg.boundary} is not in [1, {n - 1}] for a model with {n} layers")

    def prepare(self, model, ctx, layers=None) -> Setup:
        ad = adapter(model)
        if self.cfg.boundary == "auto":
            try:
                self.diagnosis = diagnose(model, ctx.diagnosis_batches(), None, progress=ctx.progress)
            except (FileNotFoundError, ValueError) as e:
                raise MethodError(f"diagnosis: {e}") from e
        boundary = int(self.cfg.boundary) if self.cfg.boundary.isdigit() else None
        layers = allocate(ad.num_layers, "freeze_deep", self.diagnosis, boundary)
        trainable = train_only(model, (p for l in layers for p in ad.layers[l].parameters()))
        return Setup(trainable, self.groups(trainable), layers, f"trains layers [0, {len(layers)})")

    def write_artifacts(self, out):
        if self.diagnosis is not None:
            self.diagnosis.to_json(out / "diagnosis.json")
            self.diagnosis.plot(out / "diagnosis.png", f"LayerTracer diagnosis ({self.cfg.diagnosis_task})")
