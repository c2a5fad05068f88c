"""The null-space projection ops of EoupCT (docs/methods.md §2): coefficients Qᵀg, the update
g ← g − Qc, and the conflict correction, each fused over a list of tensors."""
from typing import List, Sequence

import torch

from .checks import check_basis, check_device_arch, check_tensor_list, detached
from .registration import call_as_data


def null_space_coeffs(basis: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """c = Qᵀg over a list of tensors (EoupCT null-space projection, docs/methods.md §2).

    basis[i] is [k, *grads[i].shape] (float32 or bfloat16): row j is tensor i's slice of basis
    vector j. grads: float32/bfloat16/float16, and the dtypes may differ across the list. Returns
    float64 [k] with c_j = Σ_i ⟨basis_i[j], grads_i⟩, accumulated in float32 per 8192-element chunk
    and float64 across chunks in a fixed order (deterministic). Any k: no kernel keeps k values in
    shared memory (the CUDA kernels hold the coefficients in registers, 8 at a time).
    Not differentiable: the tensors are read as data (detached); the result never requires grad.
    """
    basis, grads, _ = check_basis("null_space_coeffs", basis, grads, in_place=False)
    return null_space_coeffs_prechecked(basis, grads)


def null_space_coeffs_prechecked(basis: List[torch.Tensor], grads: List[torch.Tensor]) -> torch.Tensor:
    """`null_space_coeffs` without its per-tensor checks, for lists whose every condition the
    caller has already checked (projection.GradientMemory checks a direction once per call; the
    checks cost more host time over hundreds of tensors than the kernels take on a GPU at mid sizes)."""
    return call_as_data(torch.ops.adept_ext.null_space_coeffs.default, detached(basis), detached(grads))


def null_space_apply_(basis: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], coeffs: torch.Tensor) -> None:
    """In place, grads_i ← grads_i − Σ_j coeffs_j · basis_i[j] (g ← g − Q c, docs/methods.md §2).
    coeffs: float64 [k] on the tensors' device; grads must be contiguous. Not differentiable: the
    tensors are updated as data (as an optimizer step updates parameters, also ones that require
    grad); their version counters are bumped, so a tensor saved for backward and then changed here
    makes that backward raise."""
    basis, grads, k = check_basis("null_space_apply_", basis, grads, in_place=True)
    if not isinstance(coeffs, torch.Tensor) or coeffs.dtype != torch.float64 or tuple(coeffs.shape) != (k,):
        raise ValueError(f"null_space_apply_: coeffs must be a float64 tensor of shape ({k},)")
    if coeffs.device != grads[0].device:
        raise ValueError(f"null_space_apply_: coeffs is on {coeffs.device}, the tensors on {grads[0].device}")
    null_space_apply_prechecked_(basis, grads, coeffs)


def null_space_apply_prechecked_(basis: List[torch.Tensor], grads: List[torch.Tensor], coeffs: torch.Tensor) -> None:
    """`null_space_apply_` without its per-tensor checks (see `null_space_coeffs_prechecked`)."""
    call_as_data(torch.ops.adept_ext.null_space_apply_.default, detached(basis), detached(grads), coeffs)


def conflict_correct_(g_new: Sequence[torch.Tensor], g_pre: Sequence[torch.Tensor], lam: float = 1.0,
                      eps: float = 1e-6) -> torch.Tensor:
    """EoupCT conflict correction (docs/methods.md §2), fused over a list of tensors, in place on g_new:
    with d = ⟨g_new, g_pre⟩, if d < −eps·‖g_new‖·‖g_pre‖ then g_new ← g_new − (d/‖g_pre‖²)·g_pre;
    then g_new ← g_new + lam·g_pre. The branch is decided on the device (no host sync).
    Returns float64 [4]: d, ‖g_pre‖², ‖g_new‖² (before the update) and the removed coefficient.
    Not differentiable, like `null_space_apply_` (g_new's version counters are bumped).
    """
    name = "conflict_correct_"
    g_new, g_pre = list(g_new), list(g_pre)
    if len(g_new) != len(g_pre) or not g_new:
        raise ValueError(f"{name}: g_new and g_pre must be non-empty lists of equal length, "
                         f"got {len(g_new)} and {len(g_pre)}")
    device = g_new[0].device if isinstance(g_new[0], torch.Tensor) else None
    g_new = check_tensor_list(name, "g_new", g_new, device, contiguous=True)
    g_pre = check_tensor_list(name, "g_pre", g_pre, device)
    check_device_arch(device)
    for i, (a, b) in enumerate(zip(g_new, g_pre)):
        if a.shape != b.shape:
            raise ValueError(f"{name}: g_new[{i}] has shape {tuple(a.shape)} but g_pre[{i}] has {tuple(b.shape)}")
    if eps < 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    return call_as_data(torch.ops.adept_ext.conflict_correct_.default, detached(g_new), detached(g_pre),
                        float(lam), float(eps))


@torch.library.register_fake("adept_ext::null_space_coeffs")
def _null_space_coeffs_fake(basis, grads):
    return grads[0].new_empty((basis[0].shape[0],), dtype=torch.float64)


@torch.library.register_fake("adept_ext::null_space_apply_")
def _null_space_apply_fake(basis, grads, coeffs):
    return None


@torch.library.register_fake("adept_ext::conflict_correct_")
def _conflict_correct_fake(g_new, g_pre, lam, eps):
    return g_new[0].new_empty((4,), dtype=torch.float64)
