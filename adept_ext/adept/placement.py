"""Where to put ADEPT's k copies (Stage 1, docs/methods.md §1.1–1.2, and this project's extensions).

ADEPT chooses the layers whose bypass raises the *general* loss least: it protects what the
general corpus needs. Measured on SmolLM2-135M (docs/results/investigation.md), those layers sit
mid-network and their copies absorb less of the domain than copies spread through the depth.
Each criterion below ranks layers from the probes it needs (I_g(l), I_d(l): bypass Δloss on the
general and the domain probe, `probe.layer_importance`); all return k sorted layer indices:

- `importance` (ADEPT): the k smallest I_g(l).
- `uniform` (LLaMA-Pro): the last layer of each of k equal blocks of the depth.
- `domain_aware`: the k smallest I_g(l) / I_d(l) — little needed by general text, much by the
  domain (both floored at ε = 1e-4 of the larger score's scale, so a layer whose bypass helps a
  corpus cannot flip the ratio's sign).
- `plasticity`: the k largest G_d(l) / I_g(l), where G_d(l) = ‖∂L_d/∂W_o(l)‖² + ‖∂L_d/∂W_down(l)‖²
  is the domain-probe gradient energy at layer l's two output projections: how fast the domain
  loss falls when what layer l writes into the residual stream is changed, i.e. a first-order
  estimate of what a function-preserving copy of l (whose copies of exactly these two
  projections start at 0) can absorb. Chosen over differentiating real copies of every layer
  because it needs one backward pass through the unexpanded model (no second model in memory),
  per unit of general harm I_g.
- `depth`: the k smallest I_g(l) among the deeper layers l ≥ b (b: the freeze_deep boundary —
  from a LayerTracer diagnosis with `boundary = auto`, a number, or half the depth).
- `spread` (this project's): the smallest I_g(l) within each of k equal blocks of the depth —
  ADEPT's protection, LLaMA-Pro's coverage. Motivated by the measurements above: copies after
  the least important layer of each depth quarter forgot least and gained most among the
  placements tried.
"""
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..models import adapter
from .probe import device_batch, layer_importance
from ..errors import InputError

PLACEMENTS = ("importance", "uniform", "domain_aware", "plasticity", "depth", "spread")
NEEDS_DOMAIN = ("domain_aware", "plasticity")


def _lowest(scores: Sequence[float], k: int, among: Optional[Sequence[int]] = None) -> List[int]:
    among = range(len(scores)) if among is None else among
    return sorted(sorted(among, key=lambda i: (scores[i], i))[:k])


def blocks(num_layers: int, k: int) -> List[range]:
    """k consecutive blocks covering the depth, as equal as possible."""
    edges = [round(i * num_layers / k) for i in range(k + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(k)]


def uniform(num_layers: int, k: int) -> List[int]:
    """LLaMA-Pro's placement: the last layer of each of k equal blocks."""
    return [round((i + 1) * num_layers / k) - 1 for i in range(k)]


def by_ratio(general: Sequence[float], domain: Sequence[float], k: int) -> List[int]:
    """domain_aware: the k smallest max(I_g, ε)/max(I_d, ε)."""
    eps = 1e-4 * max(max(map(abs, general)), max(map(abs, domain)), 1e-12)
    return _lowest([max(g, eps) / max(d, eps) for g, d in zip(general, domain)], k)


def by_plasticity(energy: Sequence[float], general: Sequence[float], k: int) -> List[int]:
    """plasticity: the k largest G_d / max(I_g, ε)."""
    eps = 1e-4 * max(max(map(abs, general)), 1e-12)
    return _lowest([-e / max(g, eps) for e, g in zip(energy, general)], k)


def in_depth(general: Sequence[float], k: int, boundary: int) -> List[int]:
    """depth: the k smallest I_g among layers [boundary, L); the whole depth when fewer remain."""
    deep = list(range(boundary, len(general)))
    if len(deep) < k:
        raise InputError(f"depth placement: {len(deep)} layers at or past the boundary {boundary}, fewer than k = {k}")
    return _lowest(general, k, deep)


def spread(general: Sequence[float], k: int) -> List[int]:
    """spread: the smallest I_g in each of k equal blocks of the depth."""
    return sorted(_lowest(general, 1, block)[0] for block in blocks(len(general), k))


def output_gradient_energy(model, batches) -> List[float]:
    """G_d(l) = ‖∂L/∂W_o(l)‖² + ‖∂L/∂W_down(l)‖² summed over `batches` (mean loss per batch),
    with torch.autograd.grad: the weights and the training .grad fields are untouched."""
    ad = adapter(model)
    params = [p for layer in ad.layers for p in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    flags = [p.requires_grad for p in params]
    energy = torch.zeros(len(ad.layers), dtype=torch.float64, device=params[0].device)
    was_training = model.training
    model.eval()
    try:
        for p in params:
            p.requires_grad_(True)
        for batch in batches:
            batch = device_batch(batch, params[0].device)
            labels = batch.get("labels")
            if labels is None:
                labels = batch["input_ids"].masked_fill(batch.get("attention_mask", 1) == 0, -100)
            loss = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels,
                         use_cache=False).loss
            grads = torch.autograd.grad(loss, params)
            energy += torch.stack([g.double().square().sum() for g in grads]).view(-1, 2).sum(1)
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        model.train(was_training)
    return energy.tolist()


def choose(placement: str, model, k: int, general_probe, domain_probe=None, boundary: Optional[int] = None,
           progress: bool = True) -> Dict:
    """{"layers": k sorted indices, "general": LayerScores or None, plus what the criterion
    measured}. ValueError for an unknown placement, a k outside [1, L] or a missing domain probe."""
    if placement not in PLACEMENTS:
        raise InputError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    n = adapter(model).num_layers
    if not 0 < k <= n:
        raise InputError(f"k = {k} is not in [1, {n}]")
    if placement == "uniform":
        return {"layers": uniform(n, k), "general": None}
    if placement in NEEDS_DOMAIN and not domain_probe:
        raise InputError(f"placement {placement} needs domain probe batches")
    general = layer_importance(model, general_probe, progress=progress)
    rules: Dict[str, Callable[[], Dict]] = {
        "importance": lambda: {"layers": general.select(k)},
        "spread": lambda: {"layers": spread(general.scores, k)},
        "depth": lambda: {"layers": in_depth(general.scores, k, n // 2 if boundary is None else boundary)},
        "domain_aware": lambda: _with_domain(model, general, domain_probe, k, progress),
        "plasticity": lambda: _with_energy(model, general, domain_probe, k),
    }
    return {"general": general, **rules[placement]()}


def _with_domain(model, general, domain_probe, k, progress) -> Dict:
    domain = layer_importance(model, domain_probe, progress=progress)
    return {"layers": by_ratio(general.scores, domain.scores, k), "domain": domain.scores}


def _with_energy(model, general, domain_probe, k) -> Dict:
    energy = output_gradient_energy(model, domain_probe)
    return {"layers": by_plasticity(energy, general.scores, k), "domain_gradient_energy": energy}
