"""Merging back toward the start (docs/methods.md §7): after a task, every weight the
task changed is moved back along its change,

    θ(α) = θ₀ + α_l · (θ − θ₀)

with θ₀ the weight before the first step (the base weight, an adapter's base layer, or an expansion's
function-preserving copy) and θ the trained one (a LoRA merged into its base layer). `uniform`: α_l = α
for every weight; `lines` (LiNeS): α_l grows linearly with depth from `alpha_min` at the embeddings and
the first decoder layer to α at the last layer and the head, so the shallow layers stay closer to the
start. α = 0 is the start bit for bit, α = 1 the trained model. The values are exact (held weights
read and written through `held`), on the host; one pass over the changed weights per α.
"""
from typing import Dict, List, Optional

import torch

from .errors import InputError
from .models import adapter, held

SCHEDULES = ("uniform", "lines")
GRID = tuple(i / 10 for i in range(11))  # the α an `auto` choice scores


def finished_name(name: str) -> str:
    """The name a prepared model's parameter has once the task is finished: PEFT's wrapper prefix and
    `.base_layer` gone (what `merge_and_unload` leaves)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def start_weights(model) -> Dict[str, torch.Tensor]:
    """θ₀ of a prepared model, by finished name, exact, on the host: every parameter that trains and
    every base layer of an adapter (the weights that finishing may change), less the adapters' own
    factors (`lora_`: merged into their base layer, gone after finishing)."""
    return {finished_name(name): held.exact_value(model, p).detach().to("cpu", copy=True)
            for name, p in model.named_parameters()
            if (p.requires_grad or ".base_layer." in name) and "lora_" not in name}


def layer_alphas(model, alpha: float, schedule: str = "uniform", alpha_min: float = 0.0) -> Dict[str, float]:
    """α_l of each parameter of `model` (a finished model) by name: `alpha` everywhere (uniform), or
    (lines) alpha_min + (alpha − alpha_min)·l/(L − 1) for decoder layer l of L, alpha_min for the
    embeddings (a head tied to them included), alpha for the rest (final norm, head)."""
    if schedule not in SCHEDULES:
        raise InputError(f"merge-back schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    names = {id(p): name for name, p in model.named_parameters()}
    alphas = {name: alpha for name in names.values()}
    if schedule == "uniform":
        return alphas
    ad = adapter(model)
    depth = max(1, ad.num_layers - 1)
    for layer_index, layer in enumerate(ad.layers):
        for p in layer.parameters():
            alphas[names[id(p)]] = alpha_min + (alpha - alpha_min) * layer_index / depth
    for p in ad.embed_tokens.parameters():
        alphas[names[id(p)]] = alpha_min
    return alphas


class MergeBack:
    """The trained model's changes from `start` (`start_weights`), to set any α from."""

    def __init__(self, model, start: Dict[str, torch.Tensor]):
        params = dict(model.named_parameters())
        missing = sorted(set(start) - set(params))
        if missing:
            raise InputError(f"merge-back: the finished model has no weight {missing[0]} the task started from "
                             f"({len(missing)} missing): this method's result is not one dense model")
        self.model, self.start = model, start
        self.trained = {name: held.exact_value(model, params[name]).to("cpu", copy=True) for name in start}

    def set(self, alpha: float, schedule: str = "uniform", alpha_min: float = 0.0):
        """Make the model θ₀ + α_l (θ − θ₀) (`torch.lerp`: θ₀ itself at α_l = 0 and θ at 1, bit for bit;
        held weights exact through `held.assign`)."""
        alphas = layer_alphas(self.model, alpha, schedule, alpha_min)
        params = dict(self.model.named_parameters())
        for name, value in self.start.items():
            held.assign(self.model, params[name], torch.lerp(value, self.trained[name], alphas[name]))


def choose_alpha(front: List[Dict], max_forgetting: float) -> Optional[float]:
    """The largest α of `front` ({"alpha", "general_delta"} each: the general held-out loss change from
    the base at that α) whose general forgetting is at most `max_forgetting`; α = 0 (the start, whose
    forgetting is nothing but the evaluation's rounding) where none is."""
    admissible = [point["alpha"] for point in front if point["general_delta"] <= max_forgetting]
    return max(admissible) if admissible else 0.0
