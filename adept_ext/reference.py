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


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy of hidden @ weight.T against targets (0 at ignored rows), float64 [N]
    (SPEC §1.1: the loss of every probe variant)."""
    logits = hidden.detach().double() @ weight.detach().double().T
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")


@torch.no_grad()
def bypass_layer_losses(model, batches):
    """Naive definition of ADEPT's probe (SPEC §1.1): L+1 full forwards of the HF model with
    labels, one layer bypassed at a time by a forward hook that returns the layer's input.
    Returns (base loss, [loss with layer l bypassed]), each token-weighted over the batches."""
    layers = model.model.layers

    def mean_loss(skip):
        hook = None
        if skip is not None:
            hook = layers[skip].register_forward_hook(
                lambda m, args, kwargs, out: args[0] if args else kwargs["hidden_states"], with_kwargs=True)
        try:
            total, count = 0.0, 0
            for batch in batches:
                n = int((batch["labels"][:, 1:] != -100).sum())
                total += float(model(**batch, use_cache=False).loss.double()) * n
                count += n
            return total / count
        finally:
            if hook is not None:
                hook.remove()

    return mean_loss(None), [mean_loss(l) for l in range(len(layers))]


def null_space_coeffs(basis, grads) -> torch.Tensor:
    """c = Qᵀg (SPEC §2): basis[i] is [k, *grads[i].shape]; float64 [k]."""
    k = basis[0].shape[0]
    c = torch.zeros(k, dtype=torch.float64)
    for q, g in zip(basis, grads):
        c += q.detach().double().reshape(k, g.numel()).cpu() @ g.detach().double().reshape(-1).cpu()
    return c


def null_space_project(basis, grads, coeffs=None):
    """g − Q c for every tensor, float64 copies (SPEC §2); c = Qᵀg unless given."""
    c = null_space_coeffs(basis, grads) if coeffs is None else coeffs.double().cpu()
    k = basis[0].shape[0]
    return [g.detach().double().cpu() - (c @ q.detach().double().cpu().reshape(k, g.numel())).reshape(g.shape)
            for q, g in zip(basis, grads)]


def conflict_correct(g_new, g_pre, lam: float, eps: float):
    """SPEC §2 conflict correction on float64 copies: if <g_new, g_pre> < −eps·|g_new|·|g_pre|,
    g_new ← g_new − (<g_new, g_pre>/|g_pre|²)·g_pre; then g_new + lam·g_pre."""
    a = [t.detach().double().cpu() for t in g_new]
    b = [t.detach().double().cpu() for t in g_pre]
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    pp = sum(float((y * y).sum()) for y in b)
    nn = sum(float((x * x).sum()) for x in a)
    coef = dot / pp if pp > 0 and dot < -eps * (pp * nn) ** 0.5 else 0.0
    return [x + (lam - coef) * y for x, y in zip(a, b)], coef
