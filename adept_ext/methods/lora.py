"""LoRA (Hu et al., ICLR 2022) through PEFT: a rank-r adapter (alpha = 2r, no dropout) on every
attention and MLP projection (`target_modules`: the family's, `models.Family.lora_targets`; in a
mixture of experts the attention and dense-MLP projections, not the fused expert tensors), the
base weights frozen; merged into the weights at the end, so
the saved model is a plain Hugging Face checkpoint. `seq_lora`: a fresh adapter per task,
merged after it (docs/methods.md §5)."""
from dataclasses import dataclass
from typing import ClassVar, Dict, Optional

import torch

from ..models import adapter
from .base import Method, MethodConfig, Setup, option, register
from .full import SeqFullConfig, check_freeze_bottom


def target_modules(model):
    """The projections LoRA adapts in `model` (its family's `lora_targets`)."""
    return list(adapter(model).family.lora_targets)


def add_lora(model, r: int, first_layer: int = 0):
    """`model` wrapped by PEFT with a fresh LoRA adapter of rank r on `target_modules(model)` (of the
    decoder layers from `first_layer` on, named one by one, when it is not 0): alpha = 2r (scaling 2 at
    every rank), no dropout, PEFT's init (B = 0: the output is unchanged)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules(model)
    if first_layer:
        names = {id(m): name for name, m in model.named_modules()}
        targets = [names[id(m)] for layer in adapter(model).layers[first_layer:] for part, m in layer.named_modules()
                   if part.rsplit(".", 1)[-1] in targets]
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def lora_adapters(model):
    """(module name, PEFT LoRA layer) of every adapted projection of `model`."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def subspace_overlap(previous: Dict[str, torch.Tensor], model) -> Optional[float]:
    """Mean over the adapted projections of ‖A_{<t} A_tᵀ‖_F, the overlap of the current task's
    LoRA subspace with the earlier tasks' (`previous`: their A's stacked per projection; O-LoRA's
    penalty drives it towards 0; docs/methods.md §5). None before the second task."""
    norms = [float((previous[name].to(layer.lora_A["default"].weight.device)
                    @ layer.lora_A["default"].weight.detach().float().T).norm())
             for name, layer in lora_adapters(model) if name in previous]
    return sum(norms) / len(norms) if norms else None


@dataclass(kw_only=True)
class LoraMethodConfig(MethodConfig):
    """The adapter's rank r (not PEFT's `LoraConfig`: the method builds that from r)."""

    method: ClassVar[str] = "lora"
    rank: int = option(8, "lora_rank", known_as=("rank",), help="LoRA rank")

    def __post_init__(self):
        super().__post_init__()
        self.require("rank", self.rank >= 1, "must be >= 1")


@dataclass(kw_only=True)
class SeqLoraConfig(LoraMethodConfig):
    """The rank, and the bottom layers that get no adapter after the first task."""

    method: ClassVar[str] = "seq_lora"
    freeze_bottom: int = option(0, "freeze_bottom", help=(
        "after the first task, the embeddings and the decoder layers below this one get no adapter: they keep "
        "what the first task left (Spurious Forgetting's freezing of the bottom layers; 0: every layer adapts)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("freeze_bottom", self.freeze_bottom >= 0, "must be >= 0")


@register
class Lora(Method):
    name = "lora"
    config_class = LoraMethodConfig
    description = "LoRA on every projection (PEFT), merged into the weights at the end"

    def __init__(self, config):
        super().__init__(config)
        self.peft_model = None

    def check(self, model):
        check_freeze_bottom(getattr(self.config, "freeze_bottom", 0), model)

    def first_layer(self, ctx) -> int:
        """The first decoder layer the task's adapter covers: --freeze-bottom from the second task on."""
        return getattr(self.config, "freeze_bottom", 0) if ctx.task_index else 0

    def prepare(self, model, ctx, layers=None) -> Setup:
        r = self.config.rank
        targets = target_modules(model)
        bottom = self.first_layer(ctx)
        self.peft_model = add_lora(model, r, bottom)
        trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        return Setup(trainable, self.groups(trainable, ctx), [],
                     f"trains rank-{r} LoRA adapters on {', '.join(targets)}"
                     + (f" of layers {bottom} and up" if bottom else ""))

    def end_task(self, model, out, report: Dict):
        """Merge the adapter into the weights: a plain model again."""
        merged = self.peft_model.merge_and_unload()
        self.peft_model = None
        return super().end_task(merged, out, report)


@register
class SeqLora(Lora):
    name = "seq_lora"
    config_class = SeqLoraConfig
    description = "a fresh LoRA adapter per task, merged into the weights after it"
    single_domain = False
    sequence = True
    records_subspaces = True  # keep each task's A's (O-LoRA's penalty reads them) and report the overlap

    def __init__(self, config):
        super().__init__(config)
        self.previous: Dict[str, torch.Tensor] = {}  # module name -> earlier tasks' A's stacked [Σ r_i, d_in]

    def end_task(self, model, out, report: Dict):
        """Report the task's `lora_subspace_overlap` with the earlier tasks' A's, keep its A's,
        then merge."""
        if self.records_subspaces:
            overlap = subspace_overlap(self.previous, model)
            if overlap is not None:
                report["lora_subspace_overlap"] = overlap
            for name, layer in lora_adapters(model):
                a = layer.lora_A["default"].weight.detach().float()
                self.previous[name] = torch.cat([self.previous[name].to(a.device), a]) if name in self.previous \
                    else a.clone()
        return super().end_task(model, out, report)

    def state_dict(self) -> Dict:
        return {"previous": {n: a.cpu() for n, a in self.previous.items()}}

    def load_state_dict(self, state: Dict):
        self.previous = dict(state.get("previous", {}))


def sequential_config(base: str, rank: int, freeze_bottom: int) -> MethodConfig:
    """The config of the sequential method another builds on (replay, ewc): seq_lora of `rank` for
    `base` "lora", else seq_full, both with `freeze_bottom`."""
    if base == "lora":
        return SeqLoraConfig(rank=rank, freeze_bottom=freeze_bottom)
    return SeqFullConfig(freeze_bottom=freeze_bottom)
