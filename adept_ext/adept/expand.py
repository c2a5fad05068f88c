"""ADEPT Stage 1: selective layer expansion with function-preserving init (docs/methods.md §1.2).

For each chosen layer l a deep copy is inserted right after it; in the copy the residual
outputs its family declares (`models.Family`: the attention output `o_proj` and MLP output
`down_proj`, or every expert's down projection) — and their biases — are zeroed, so the copy
adds nothing to the residual stream and the expanded model computes exactly what the original
did. Every original parameter is frozen; only the copies train. The bookkeeping that keeps the
model a plain Hugging Face model is done here: attention `layer_idx` renumbered (KV cache),
`num_hidden_layers`, the per-layer config lists (`layer_types`, SmolLM3's `no_rope_layers`,
Qwen3-MoE's `mlp_only_layers`) and `max_window_layers` updated, tied embeddings left tied, and
`config.adept = {"expanded_layers": [...], "source_layers": [...]}` recorded.
"""
import copy
from typing import List, Optional, Sequence

import torch

from ..models import adapter, held


def select_layers(scores, k: Optional[int] = None, trainable_fraction: Optional[float] = None, model=None) -> List[int]:
    """The least important layers by `scores` (a LayerScores): either the k lowest, or as many as
    fit in `trainable_fraction` of the expanded model's parameters (needs `model`)."""
    if (k is None) == (trainable_fraction is None):
        raise ValueError("give exactly one of k and trainable_fraction")
    if k is not None:
        return scores.select(k)
    if model is None:
        raise ValueError("selection by trainable_fraction needs the model (to count parameters)")
    if not 0 < trainable_fraction < 1:
        raise ValueError(f"trainable_fraction must be in (0, 1), got {trainable_fraction}")
    ad = adapter(model)
    total = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in ad.layers]
    order = sorted(range(len(per_layer)), key=lambda i: (scores.scores[i], i))
    chosen, added = [], 0
    for i in order:
        if (added + per_layer[i]) / (total + added + per_layer[i]) > trainable_fraction:
            break
        chosen.append(i)
        added += per_layer[i]
    return sorted(chosen)


def _zero_output_projections(ad, layer):
    for tensor in ad.residual_outputs(layer):
        tensor.data.zero_()


def _expanded_lists(config, family, chosen, n):
    """The config's per-layer lists (`Family.layer_lists`: one entry per layer, duplicated for a
    copy) and layer-index lists (`Family.layer_index_lists`: indices shifted, a copy added beside
    its source) for copies after the layers in `chosen` of an n-layer model."""
    new_index = {i: i + sum(1 for c in chosen if c < i) for i in range(n)}
    lists = {}
    for name in family.layer_lists:
        values = getattr(config, name, None)
        if values is not None:
            lists[name] = [v for i, v in enumerate(list(values)[:n]) for _ in range(2 if i in chosen else 1)]
    for name in family.layer_index_lists:
        values = getattr(config, name, None)
        if values is not None:
            lists[name] = sorted(new_index[i] + k for i in values if i < n for k in range(2 if i in chosen else 1))
    return lists


def expand_layers(model, layers: Sequence[int]) -> List[torch.nn.Parameter]:
    """Insert a function-preserving copy after each layer in `layers` (indices of the current
    model), freeze everything else and return the trainable parameters (those of all copies,
    including copies from earlier expansions). Raises ValueError, leaving the model untouched,
    for non-int, negative, out-of-range or duplicate indices, for an architecture that
    `models.adapter` refuses (InputError, a ValueError: e.g. Qwen3.5's linear-attention layers),
    and for a mixture of experts whose `decoder_sparse_step` is not 1 (mixtures of experts with
    every layer sparse, or dense layers listed in `mlp_only_layers`, are expanded).
    An empty `layers` (k = 0) is a no-op that returns the parameters of existing copies.
    """
    ad = adapter(model)
    n = ad.num_layers
    layers = list(layers)
    for l in layers:
        if not isinstance(l, int) or isinstance(l, bool):
            raise ValueError(f"layer indices must be ints, got {l!r}")
        if not 0 <= l < n:
            raise ValueError(f"layer index {l} is out of range for a model with {n} layers")
    if len(set(layers)) != len(layers):
        raise ValueError(f"duplicate layer indices in {layers}")
    config = ad.config
    if not layers:
        expanded = (getattr(config, "adept", None) or {}).get("expanded_layers", [])
        return [p for idx in expanded for p in ad.layers[idx].parameters()]
    chosen = set(layers)
    previous = getattr(config, "adept", None) or {"expanded_layers": [], "source_layers": []}

    # Build everything first; the model is modified only once all of it succeeded.
    new_layers, new_index = [], {}
    copies = []  # (new index of copy, new index of source)
    for i, layer in enumerate(ad.layers):
        new_index[i] = len(new_layers)
        new_layers.append(layer)
        if i in chosen:
            clone = copy.deepcopy(layer)
            for source, copied in zip(layer.parameters(), clone.parameters()):  # exact, where the load held them
                copied.data = held.exact_value(model, source).to(copied.device, copy=True)
            _zero_output_projections(ad, clone)
            copies.append((len(new_layers), new_index[i]))
            new_layers.append(clone)
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    if ad.family.moe and sparse_step != 1:  # Qwen MoE: layer i sparse when (i + 1) % step == 0, a pattern a copy breaks
        raise ValueError(f"decoder_sparse_step={sparse_step}: inserting a layer would change which later layers are "
                         "mixtures of experts; only decoder_sparse_step 1 (mlp_only_layers lists the dense ones) "
                         "can be expanded")
    lists = _expanded_lists(config, ad.family, chosen, n)
    expanded = [new_index[e] for e in previous["expanded_layers"]] + [c for c, _ in copies]
    sources = [new_index[s] for s in previous["source_layers"]] + [s for _, s in copies]
    order = sorted(range(len(expanded)), key=lambda j: expanded[j])

    ad.decoder.layers = torch.nn.ModuleList(new_layers)
    for idx, layer in enumerate(new_layers):
        layer.self_attn.layer_idx = idx
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = idx
    config.num_hidden_layers = len(new_layers)
    for name, values in lists.items():
        setattr(config, name, values)
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = sum(1 for i in range(min(config.max_window_layers, n))
                                       for _ in range(2 if i in chosen else 1))
    expanded, sources = [expanded[j] for j in order], [sources[j] for j in order]
    config.adept = {"expanded_layers": expanded, "source_layers": sources,
                    "source_layers_before_expansion": [s - sum(c < s for c in expanded) for s in sources],
                    "numbering": "expanded_layers and source_layers index this (expanded) model; "
                                 "source_layers_before_expansion index the model before any layer was copied"}

    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    for idx in config.adept["expanded_layers"]:
        for p in new_layers[idx].parameters():
            p.requires_grad_(True)
            trainable.append(p)
    return trainable
