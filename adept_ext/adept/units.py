"""ADEPT Stage 2 units and their importance (docs/methods.md §1.3).

Units are the parameter tensors of the expanded layers (q/k/v/o projections and biases,
gate/up/down projections, input/post-attention norms, q_norm/k_norm). A unit's importance is
the mean first-order Taylor score over its elements, I_U = (1/|U|) Σ_{j∈U} θ_j·∇_j L, on probe
batches: `abs` (default, as the released code: mean over batches of |θ⊙g_b|) or `signed`
(the paper's form). Scores are normalised to Î ∈ [0, 1] within each unit kind (attention, mlp,
norm), since norm vectors (|θ|≈1) would otherwise dominate the matrices. The default is the rank
form, Î = rank/(n−1), whose mean is 0.5, so that lr_U = 2·(1 − Î_U)·lr keeps the mean rate at lr:
min–max (`per_kind`, as the released code but per kind) gave a mean multiplier of 1.29 on
SmolLM2-135M with 4 copies (`tools/bench.py lr`), rank 1.01.
"""
import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..models import adapter
from ..ops import taylor_importance

MODES = ("abs", "signed")
NORMALIZATIONS = ("per_kind", "global", "rank")
AUTOCAST_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def check_autocast_dtype(dtype):
    """None/float32 (no autocast), bfloat16 or float16; raises ValueError otherwise."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class Unit:
    """One parameter tensor of an expanded layer."""

    name: str          # the parameter's name in the model
    layer: int         # index of the copy in the expanded model
    source_layer: int  # index of the layer it was copied from
    kind: str          # "attention", "mlp", "norm" or (mixtures of experts) "router"
    source_name: str   # name of the same tensor in the source layer


def _kind(local_name: str, moe: bool = False) -> str:
    if "norm" in local_name:
        return "norm"
    if moe and local_name.startswith("mlp.gate."):  # a mixture of experts' router (its experts stay "mlp")
        return "router"
    if local_name.startswith("self_attn."):
        return "attention"
    if local_name.startswith("mlp."):
        return "mlp"
    raise ValueError(f"cannot classify parameter {local_name!r} as attention, mlp or norm")


def partition(model) -> List[Unit]:
    """The units of the expanded layers recorded in `config.adept`, one per parameter tensor.
    Raises ValueError for a model with no expanded layers."""
    ad = adapter(model)
    info = getattr(ad.config, "adept", None) or {}
    expanded, sources = info.get("expanded_layers", []), info.get("source_layers", [])
    if not expanded:
        raise ValueError("the model has no expanded layers (config.adept is missing or empty): run expand_layers first")
    prefix = next(name for name, module in model.named_modules() if module is ad.layers)
    units = []
    for layer, source in zip(expanded, sources):
        for local, _ in ad.layers[layer].named_parameters():
            units.append(Unit(f"{prefix}.{layer}.{local}", layer, source, _kind(local, ad.family.moe),
                              f"{prefix}.{source}.{local}"))
    return units


def mean_importance(
    sums: torch.Tensor,
    numels: Sequence[int],
    groups: Optional[Sequence[int]] = None,
    num_batches: int = 1,
) -> torch.Tensor:
    """Means of `taylor_importance` sums, float32 [n_groups, 2] (columns: signed, absolute).

    sums: [n, 2] sums over tensors (possibly accumulated over `num_batches` probe batches).
    numels: element count of each tensor. groups: optional unit index of each tensor
    (0..n_groups-1); without it every tensor is its own group. Group g's mean is
    Σ_{i∈g} sums_i / (num_batches · Σ_{i∈g} numel_i). Stays on sums' device (no host sync).
    Raises ValueError on mismatched lengths, bad group indices, empty groups or num_batches < 1.
    """
    if sums.dim() != 2 or sums.shape[1] != 2:
        raise ValueError(f"mean_importance: sums must have shape [n, 2], got {tuple(sums.shape)}")
    n = sums.shape[0]
    if len(numels) != n:
        raise ValueError(f"mean_importance: {n} rows of sums but {len(numels)} numels")
    if num_batches < 1:
        raise ValueError(f"mean_importance: num_batches must be >= 1, got {num_batches}")
    if groups is None:
        groups = range(n)
    if len(groups) != n:
        raise ValueError(f"mean_importance: {n} rows of sums but {len(groups)} group indices")
    if n and min(groups) < 0:
        raise ValueError(f"mean_importance: negative group index {min(groups)}")
    n_groups = max(groups) + 1 if n else 0
    counts = [0] * n_groups
    for g, k in zip(groups, numels):
        counts[g] += int(k)
    empty = [g for g, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(f"mean_importance: group {empty[0]} has no elements")
    index = torch.as_tensor(list(groups), dtype=torch.long, device=sums.device)
    totals = torch.zeros(n_groups, 2, dtype=torch.float64, device=sums.device)
    totals.index_add_(0, index, sums.double())
    denom = torch.as_tensor(counts, dtype=torch.float64, device=sums.device) * num_batches
    return (totals / denom[:, None]).float()


def normalize_scores(scores: Sequence[float], kinds: Sequence[str], normalize: str = "per_kind") -> List[float]:
    """Î ∈ [0, 1]: min–max within each kind (`per_kind`), across all units (`global`), or
    rank/(n−1) within each kind (`rank`, whose mean is exactly 0.5). A group whose scores are
    all equal gets Î = 0.5."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    groups: Dict[str, List[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault("all" if normalize == "global" else k, []).append(i)
    out = [0.5] * len(scores)
    for idx in groups.values():
        vals = [scores[i] for i in idx]
        if normalize == "rank":
            order = sorted(range(len(idx)), key=lambda j: (vals[j], j))
            for r, j in enumerate(order):
                out[idx[j]] = r / (len(idx) - 1) if len(idx) > 1 else 0.5
            continue
        lo, hi = min(vals), max(vals)
        for i, v in zip(idx, vals):
            out[i] = (v - lo) / (hi - lo) if hi > lo else 0.5
    return out


def _sharded_grads(loss, params, every_param) -> List[Optional[torch.Tensor]]:
    """FSDP2: `loss.backward()` (FSDP reduce-scatters the gradients), this rank's local shard of
    each of `params`' gradients (None: no gradient), and every `.grad` cleared for the next batch."""
    for p in every_param:
        p.grad = None
    loss.backward()
    grads = [None if p.grad is None else p.grad.to_local() for p in params]
    for p in every_param:
        p.grad = None
    return grads


class UnitImportance:
    """Taylor importance of the units of an expanded model on fixed probe batches (docs/methods.md §1.3).

    `compute()` runs forward/backward on every probe batch with `torch.autograd.grad` (the
    training `.grad` fields and the weights are untouched), accumulates the per-tensor θ⊙g sums
    on the device with the fused `taylor_importance` op and synchronises with the host once.
    `compute(use_source=True)` scores the source layers' tensors instead: the fresh copies
    score exactly 0 (θ = 0 in o_proj/down_proj, ∇ = 0 upstream of them), so that is what ADEPT
    uses before the first recompute (a unit that scores exactly 0 is named in `zero_units` and
    warned about: it would get the highest rate). Under an initialised process group the sums and token
    counts are all-reduced before normalising, so every rank gets the same scores. On a model
    sharded by FSDP2 (`fully_shard`) every rank instead goes through every probe batch (the same
    all-gathers and reduce-scatters on every rank, whatever the batch count, so the averaged
    gradient is the batch's own): the gradients come from `backward()` (the training `.grad` are
    set aside and put back), the fused op takes each rank's local shards, and the partial sums
    are all-reduced.

    `autocast_dtype` (None, torch.float32, torch.bfloat16 or torch.float16): the probe's
    forward runs under `torch.autocast(device_type, dtype)`, as the training step does (pass
    the training's dtype; issue 11 measured the fp32 recompute at 3.8× the bf16 one on an
    H200). None or float32 (default): no autocast, the model's own dtype. The θ⊙g sums are
    float32 either way (the gradients have the parameters' dtype).
    """

    def __init__(self, model, probe_batches, mode: str = "abs", normalize: str = "rank", autocast_dtype=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        self.model = adapter(model).model  # under DDP, probe the module itself (no reducer hooks)
        self.units = partition(self.model)
        self.probe_batches = list(probe_batches)
        if not self.probe_batches:
            raise ValueError("probe data is empty: no batches")
        self.mode, self.normalize = mode, normalize
        self.autocast_dtype = check_autocast_dtype(autocast_dtype)
        self.zero_units: List[str] = []  # units the last call scored exactly 0 (also warned)

    def raw_scores(self, use_source: bool = False, autocast_dtype=None) -> List[float]:
        """Mean θ·g (signed or absolute) per unit, averaged over the probe batches. `autocast_dtype`
        overrides the instance's setting for this call (torch.float32: no autocast; None: keep it)."""
        dtype = self.autocast_dtype if autocast_dtype is None else check_autocast_dtype(autocast_dtype)
        names = [u.source_name if use_source else u.name for u in self.units]
        by_name = dict(self.model.named_parameters())  # looked up per call: fully_shard replaces them
        params = [by_name[n] for n in names]
        device = params[0].device
        sums = torch.zeros(len(params), 2, dtype=torch.float32, device=device)
        batches = self.probe_batches
        sharded = isinstance(params[0], DTensor)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and not sharded:
            batches = batches[dist.get_rank()::dist.get_world_size()]
        flags = [p.requires_grad for p in params]
        training_grads = [(p, p.grad) for p in by_name.values()] if sharded else []
        was_training = self.model.training
        self.model.eval()
        try:
            for p in params:
                p.requires_grad_(True)  # frozen sources need a gradient too; restored below
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast(device.type, dtype=dtype, enabled=dtype not in (None, torch.float32)):
                    loss = self.model(**batch, use_cache=False).loss
                grads = _sharded_grads(loss, params, by_name.values()) if sharded else \
                    torch.autograd.grad(loss, params, allow_unused=True)
                unused = [n for n, g in zip(names, grads) if g is None]
                if unused:  # scoring it 0 would silently give it the highest rate (2x)
                    raise ValueError(f"unit {unused[0]} (and {len(unused) - 1} more) receives no gradient from the "
                                     "probe loss: the forward pass does not use it")
                taylor_importance(params if not sharded else [p.to_local() for p in params], grads, out=sums,
                                  accumulate=True)
        finally:
            for p, f in zip(params, flags):
                p.requires_grad_(f)
            for p, g in training_grads:
                p.grad = g
            self.model.train(was_training)
        num_batches = len(batches)
        if sharded:  # each rank summed its shards of every batch
            dist.all_reduce(sums)
        elif distributed:
            count = torch.tensor([float(num_batches)], dtype=torch.float32, device=device)
            dist.all_reduce(sums)
            dist.all_reduce(count)
            num_batches = int(count.item())
        means = mean_importance(sums, [p.numel() for p in params], num_batches=max(1, num_batches))
        column = means[:, 1 if self.mode == "abs" else 0].tolist()  # the one host sync
        bad = [n for n, v in zip(names, column) if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"non-finite gradient or weight in unit {bad[0]} (and {len(bad) - 1} more)")
        self.zero_units = [n for n, v in zip(names, column) if v == 0.0]
        if self.zero_units:  # all-zero θ⊙g: scored 0, i.e. the highest rate; said, not silent
            warnings.warn(f"unit {self.zero_units[0]} (and {len(self.zero_units) - 1} more) scores exactly 0 "
                          "(θ⊙g is 0 everywhere: a fresh copy before training, or a gradient of zeros) and gets "
                          "the highest rate; score the source layers instead with use_source=True", stacklevel=2)
        return column

    def compute(self, use_source: bool = False, autocast_dtype=None) -> List[float]:
        """Normalised importance Î ∈ [0, 1] per unit (order of `self.units`)."""
        return normalize_scores(self.raw_scores(use_source, autocast_dtype), [u.kind for u in self.units],
                                self.normalize)
