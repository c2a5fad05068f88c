"""Unit importance for ADEPT Stage 2 (SPEC §1.3): from Taylor-importance sums to means per
tensor, per unit and per probe batch.

ADEPT's unit importance (SPEC §1.3) is I_U = (1/|U|) Σ_{j∈U} I_j with I_j = θ_j·∇_j L, and the
released code averages |θ⊙g_b| over probe batches b. `taylor_importance` gives the sums;
this module divides them by element counts and batch counts.
"""
from typing import Optional, Sequence

import torch


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
