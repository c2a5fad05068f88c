"""Plain-PyTorch definitions of every adept_ext op: the specification the kernels are tested against.

Each function computes in float64, so tests can measure the error of a kernel and of plain
PyTorch in low precision against the same exact-ish result.
"""
from typing import Sequence

import torch


def taylor_importance(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """First-order Taylor importance sums per tensor (SPEC §1.3), float64 [n, 2]:
    column 0 = Σ_j θ_j·g_j, column 1 = Σ_j |θ_j·g_j|."""
    rows = []
    for p, g in zip(params, grads):
        x = p.detach().double() * g.detach().double()
        rows.append(torch.stack([x.sum(), x.abs().sum()]))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.float64)
    return torch.stack(rows)
