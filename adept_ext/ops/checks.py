"""Argument checks shared by the op wrappers (DESIGN: checks happen in one place, with the offending
index and what was expected), and the check that the build has code for the GPU an op runs on."""
import functools
from typing import Optional

import torch

from .. import _cuda_arch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BASIS_DTYPES = (torch.float32, torch.bfloat16)


def detached(tensors):
    """The list itself when no tensor requires grad (the usual case: a detach per tensor costs a
    few microseconds, which add up over hundreds of tensors per call), else detached views. The
    wrappers of the ops that are not differentiable read their tensors through it."""
    return [t.detach() for t in tensors] if any(t.requires_grad for t in tensors) else tensors


def compiled_cuda_arch_list() -> Optional[str]:
    """The TORCH_CUDA_ARCH_LIST this build's CUDA kernels were compiled for (written by setup.py);
    None for a CPU-only build or a build that predates the record."""
    try:
        from .._build_info import CUDA_ARCH_LIST
    except ImportError:
        return None
    return CUDA_ARCH_LIST


@functools.lru_cache(maxsize=None)
def check_cuda_device(index: int) -> None:
    """Raise RuntimeError when the compiled CUDA kernels cannot run on GPU `index` (cached per GPU)."""
    arch_list = compiled_cuda_arch_list()
    if arch_list is None:  # unknown (no record): let the launch speak for itself
        return
    message = _cuda_arch.mismatch_message(arch_list, torch.cuda.get_device_capability(index),
                                          f"GPU {index} ({torch.cuda.get_device_name(index)})")
    if message:
        raise RuntimeError(message)


def check_device_arch(device) -> None:
    """Before the first launch on a GPU: a clear error when the build has no code for it."""
    if device is not None and device.type == "cuda" and not torch.compiler.is_compiling():
        check_cuda_device(device.index if device.index is not None else torch.cuda.current_device())


def _pairs_ok(params, grads):
    """All of check_tensor_pairs's conditions in one pass without messages (the per-call fast
    path); returns (ok, common device)."""
    device = None
    for p, g in zip(params, grads):
        if not (isinstance(p, torch.Tensor) and isinstance(g, torch.Tensor) and p.dtype in SUPPORTED_DTYPES
                and g.dtype in SUPPORTED_DTYPES):
            return False, None
        if device is None:
            device = p.device
        if p.device != device or g.device != device or p.shape != g.shape:
            return False, None
    return True, device


def check_tensor_pairs(name: str, params, grads):
    """Validate two parallel tensor lists; returns them as lists (detached) and their common device."""
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"{name}: got {len(params)} params but {len(grads)} grads")
    ok, device = _pairs_ok(params, grads)
    if ok:
        check_device_arch(device)
        return detached(params), detached(grads), device
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            raise ValueError(f"{name}: grads[{i}] is None (parameter {i} received no gradient)")
        for label, t in (("params", p), ("grads", g)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: {label}[{i}] is a {type(t).__name__}, expected a torch.Tensor")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name}: {label}[{i}] has dtype {t.dtype}; supported: float32, bfloat16, float16")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{name}: {label}[{i}] is on {t.device}, but the other tensors are on {device}")
        if p.shape != g.shape:
            raise ValueError(f"{name}: params[{i}] has shape {tuple(p.shape)} but grads[{i}] has {tuple(g.shape)}")
    check_device_arch(device)
    return detached(params), detached(grads), device


def check_tensor_list(name: str, label: str, tensors, device, dtypes=SUPPORTED_DTYPES, contiguous=False):
    """Validate one tensor list (types, dtypes, one device, contiguity); returns it as a list."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if t is None:
            raise ValueError(f"{name}: {label}[{i}] is None (missing gradient?)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {label}[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: {label}[{i}] has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")
        if device is not None and t.device != device:
            raise ValueError(f"{name}: {label}[{i}] is on {t.device}, expected {device}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{name}: {label}[{i}] must be contiguous (it is updated in place)")
    return tensors


def _basis_ok(basis, grads, in_place: bool) -> bool:
    """All of check_basis's conditions in one pass without messages: the per-call fast path."""
    q0 = basis[0]
    if not isinstance(q0, torch.Tensor) or q0.dim() == 0:
        return False
    device, k = q0.device, q0.shape[0]
    for q, g in zip(basis, grads):
        if not (isinstance(q, torch.Tensor) and isinstance(g, torch.Tensor) and q.dtype in BASIS_DTYPES
                and g.dtype in SUPPORTED_DTYPES and q.device == device and g.device == device):
            return False
        shape = q.shape
        if len(shape) != g.dim() + 1 or shape[0] != k or shape[1:] != g.shape or (in_place and not g.is_contiguous()):
            return False
    return True


def check_basis(name: str, basis, grads, in_place: bool):
    """Validate a null-space basis against its gradients; returns (basis, grads, k)."""
    basis, grads = list(basis), list(grads)
    if len(basis) != len(grads):
        raise ValueError(f"{name}: got {len(basis)} basis tensors but {len(grads)} grads")
    if not basis:
        raise ValueError(f"{name}: empty tensor lists")
    if _basis_ok(basis, grads, in_place):
        check_device_arch(basis[0].device)
        return basis, grads, basis[0].shape[0]
    device = basis[0].device if isinstance(basis[0], torch.Tensor) else None
    basis = check_tensor_list(name, "basis", basis, device, BASIS_DTYPES)
    grads = check_tensor_list(name, "grads", grads, device, contiguous=in_place)
    k = basis[0].shape[0] if basis[0].dim() else None
    for i, (q, g) in enumerate(zip(basis, grads)):
        if q.dim() != g.dim() + 1 or q.shape[0] != k or q.shape[1:] != g.shape:
            raise ValueError(f"{name}: basis[{i}] has shape {tuple(q.shape)}; expected ({k}, *{tuple(g.shape)}) "
                             "with the same k for every tensor")
    check_device_arch(device)
    return basis, grads, k
