"""Typed wrappers of the compiled ops: argument checks with clear messages, and the fake
(meta) implementations that let the ops trace under torch.compile(fullgraph=True)."""
from typing import Optional, Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tensor_pairs(name: str, params, grads):
    """Validate two parallel tensor lists; returns them as lists and their common device."""
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"{name}: got {len(params)} params but {len(grads)} grads")
    device = None
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
    return [p.detach() for p in params], [g.detach() for g in grads], device


def taylor_importance(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Fused first-order Taylor importance sums, one pass over all tensors (ADEPT, SPEC §1.3).

    Returns float32 [len(params), 2]: row i = [Σ_j θ_j·g_j, Σ_j |θ_j·g_j|] over the elements
    of params[i] and grads[i]. θ and g must have equal shapes; their dtypes (float32, bfloat16,
    float16) may differ, also across the list. Accumulation is float32 per 32768-element chunk
    and float64 across chunks, in a fixed order: repeated calls are bit-identical. NaN/Inf in
    the inputs propagate into that tensor's row (callers that need finite scores check the rows).
    Non-contiguous tensors are read through a contiguous copy.

    With ``out`` (float32 [n, 2] on the inputs' device) the sums are written into it, or added
    onto it when ``accumulate=True`` (no host synchronisation: a probe loop over batches
    accumulates Σ_b |θ⊙g_b| on the device). Raises ValueError/TypeError, naming the offending
    index, before anything is written.
    """
    params, grads, device = _check_tensor_pairs("taylor_importance", params, grads)
    n = len(params)
    if out is None:
        if accumulate:
            raise ValueError("taylor_importance: accumulate=True needs an `out` tensor to add into")
        if n == 0:
            return torch.zeros(0, 2, dtype=torch.float32)
        return torch.ops.adept_ext.taylor_importance.default(params, grads)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"taylor_importance: out is a {type(out).__name__}, expected a torch.Tensor")
    if out.dtype != torch.float32 or tuple(out.shape) != (n, 2) or not out.is_contiguous():
        raise ValueError(
            f"taylor_importance: out must be a contiguous float32 tensor of shape ({n}, 2), "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' non-contiguous'}"
        )
    if device is not None and out.device != device:
        raise ValueError(f"taylor_importance: out is on {out.device}, but the inputs are on {device}")
    if n > 0:
        torch.ops.adept_ext.taylor_importance_out.default(params, grads, out, accumulate)
    return out


@torch.library.register_fake("adept_ext::taylor_importance")
def _taylor_importance_fake(params, grads):
    return params[0].new_empty((len(params), 2), dtype=torch.float32)


@torch.library.register_fake("adept_ext::taylor_importance_out")
def _taylor_importance_out_fake(params, grads, out, accumulate):
    return None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Per-row cross-entropy of the logits hidden @ weight.T, without materialising them (SPEC §1.1).

    hidden [N, H] and weight [V, H] (float32, bfloat16 or float16, same dtype and device),
    targets [N] int64 in [0, V) or ``ignore_index``. Returns float32 [N]:
    loss_i = logsumexp_v(h_i·w_v) − h_i·w_{t_i}, and 0 at ignored rows. Rows are processed
    ``chunk_rows`` at a time (default: about 2^23 logits per chunk), so the peak extra memory
    is O(chunk_rows × V), never O(N × V). The GEMM runs in the inputs' dtype (as
    ``hidden @ weight.T`` would); the logsumexp is float32. Forward only.
    Raises ValueError/TypeError on bad shapes, dtypes, devices and out-of-range targets.
    """
    name = "linear_cross_entropy"
    for label, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {label} is a {type(t).__name__}, expected a torch.Tensor")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"{name}: expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: hidden has {hidden.shape[1]} features but weight has {weight.shape[1]}")
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{name}: {hidden.shape[0]} hidden rows but {targets.shape[0]} targets")
    if hidden.dtype not in SUPPORTED_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"{name}: hidden and weight must share a dtype of float32/bfloat16/float16; "
                        f"got {hidden.dtype} and {weight.dtype}")
    if targets.dtype != torch.int64:
        raise TypeError(f"{name}: targets must be int64, got {targets.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"{name}: hidden, weight and targets must be on one device; got "
                         f"{hidden.device}, {weight.device}, {targets.device}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"{name}: chunk_rows must be a positive int or None, got {chunk_rows!r}")
    if hidden.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=hidden.device)
    if weight.shape[0] == 0:
        raise ValueError(f"{name}: weight has no rows (vocabulary of size 0)")
    if not torch.compiler.is_compiling():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{name}: targets[{i}] = {int(targets[i])} is outside [0, {weight.shape[0]}) "
                             f"and is not ignore_index ({ignore_index})")
    return torch.ops.adept_ext.linear_cross_entropy.default(
        hidden.detach(), weight.detach(), targets, ignore_index, chunk_rows or 0)


@torch.library.register_fake("adept_ext::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, targets, ignore_index, chunk_rows):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
