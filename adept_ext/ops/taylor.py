"""`taylor_importance`: fused first-order Taylor importance sums over a list of tensors."""
from typing import Optional, Sequence

import torch

from .checks import check_tensor_pairs
from .registration import call_as_data


def taylor_importance(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Fused first-order Taylor importance sums, one pass over all tensors (ADEPT, docs/methods.md §1.3).

    Returns float32 [len(params), 2]: row i = [Σ_j θ_j·g_j, Σ_j |θ_j·g_j|] over the elements
    of params[i] and grads[i]. θ and g must have equal shapes; their dtypes (float32, bfloat16,
    float16) may differ, also across the list. Accumulation is float32 per 32768-element chunk
    and float64 across chunks, in a fixed order: repeated calls are bit-identical. NaN/Inf in
    the inputs propagate into that tensor's row (callers that need finite scores check the rows).
    Non-contiguous tensors are read through a contiguous copy.

    With ``out`` (float32 [n, 2] on the inputs' device) the sums are written into it, or added
    onto it when ``accumulate=True`` (no host synchronisation: a probe loop over batches
    accumulates Σ_b |θ⊙g_b| on the device). A call allocates no metadata buffer and copies
    nothing to the device, so it can be captured in a CUDA graph. Raises ValueError/TypeError, naming the offending
    index, before anything is written. Not differentiable: params and grads are read as data
    (detached), so the result never requires grad, also for parameters that do.
    """
    params, grads, device = check_tensor_pairs("taylor_importance", params, grads)
    n = len(params)
    if out is None:
        if accumulate:
            raise ValueError("taylor_importance: accumulate=True needs an `out` tensor to add into")
        if n == 0:
            return torch.zeros(0, 2, dtype=torch.float32)
        return call_as_data(torch.ops.adept_ext.taylor_importance.default, params, grads)
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
        call_as_data(torch.ops.adept_ext.taylor_importance_out.default, params, grads, out, accumulate)
    return out


@torch.library.register_fake("adept_ext::taylor_importance")
def _taylor_importance_fake(params, grads):
    return params[0].new_empty((len(params), 2), dtype=torch.float32)


@torch.library.register_fake("adept_ext::taylor_importance_out")
def _taylor_importance_out_fake(params, grads, out, accumulate):
    return None
