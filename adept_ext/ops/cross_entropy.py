"""`linear_cross_entropy`: per-row cross-entropy of hidden @ weight.T without materialising the
logits, forward and backward (docs/methods.md §1.1)."""
import functools
from typing import Callable, Optional, Tuple

import torch

from . import torch_internals
from .checks import SUPPORTED_DTYPES, check_device_arch
from .registration import LIB

# linear_cross_entropy's default chunking bounds the logits of one chunk, the GEMM's output.
# CPU: 2^23 logits (32 MB in float32; the kernel's own default, sized for 2 cores' caches); 2^25 when
# gradients are computed, whose weight-gradient GEMM (dᵀh) has the chunk's rows as its inner
# dimension: at V = 49152, H = 576 on 2 cores the gradient loop ran 5.07 s at 170 rows (2^23) and
# 2.23 s at 682 (2^25), as fast as plain torch's unchunked GEMMs (tools/bench.py linear_ce).
# GPU: 256 MiB of logits in the GEMM's dtype and at least 1024 rows: a 2^23-logit chunk is 65 rows
# at V = 128k, which made every GEMM tiny on an H200 (43 ms vs 8.3 ms at 1024 rows, issue 11).
CPU_CHUNK_LOGITS = 1 << 23
CPU_GRAD_CHUNK_LOGITS = 1 << 25
GPU_CHUNK_BYTES = 256 << 20
GPU_MIN_CHUNK_ROWS = 1024


def default_chunk_rows(vocab: int, device: torch.device, dtype: torch.dtype, grad: bool = False) -> int:
    """Rows per chunk that `linear_cross_entropy` uses when `chunk_rows` is None (see above);
    `grad`: the call computes gradients."""
    vocab = max(int(vocab), 1)
    if torch.device(device).type == "cpu":
        return max(1, (CPU_GRAD_CHUNK_LOGITS if grad else CPU_CHUNK_LOGITS) // vocab)
    rows = GPU_CHUNK_BYTES // (vocab * dtype.itemsize)
    return max(GPU_MIN_CHUNK_ROWS, rows // 128 * 128)


def _check_args(name: str, hidden, weight, targets, chunk_rows) -> torch.dtype:
    """The wrappers' argument checks (ValueError/TypeError); returns the dtype the GEMMs run in."""
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
    autocast = torch.is_autocast_enabled(hidden.device.type)  # both are cast to the autocast dtype
    if hidden.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES or \
            (weight.dtype != hidden.dtype and not autocast):
        raise TypeError(f"{name}: hidden and weight must share a dtype of float32/bfloat16/float16 (or run "
                        f"under autocast); got {hidden.dtype} and {weight.dtype}")
    if targets.dtype != torch.int64:
        raise TypeError(f"{name}: targets must be int64, got {targets.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"{name}: hidden, weight and targets must be on one device; got "
                         f"{hidden.device}, {weight.device}, {targets.device}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"{name}: chunk_rows must be a positive int or None, got {chunk_rows!r}")
    if weight.shape[0] == 0 and hidden.shape[0] > 0:
        raise ValueError(f"{name}: weight has no rows (vocabulary of size 0)")
    check_device_arch(hidden.device)
    return torch.get_autocast_dtype(hidden.device.type) if autocast else hidden.dtype


REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    reduction: str = "none",
) -> torch.Tensor:
    """Cross-entropy of the logits hidden @ weight.T, without materialising them (docs/methods.md §1.1),
    reduced as ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index, reduction=reduction)``.

    hidden [N, H] and weight [V, H] (float32, bfloat16 or float16, same dtype and device),
    targets [N] int64 in [0, V) or ``ignore_index``; per row loss_i = logsumexp_v(h_i·w_v) − h_i·w_{t_i},
    and 0 at ignored rows. ``reduction``:

    - ``"none"``: float32 [N], the rows. Differentiable (see `linear_cross_entropy_backward`: the
      backward recomputes one chunk of logits at a time, so it never holds [N, V] either).
    - ``"sum"``: float32 scalar Σ_i loss_i (the same rows, summed in the same order), and
    - ``"mean"``: float32 scalar Σ_i loss_i / n_valid, n_valid the count of rows whose target is not
      ``ignore_index``. With no valid row (all ignored, or N = 0) the loss is NaN and the gradients
      are 0, as F.cross_entropy gives. Both compute the gradients during the forward (as Liger's
      fused loss does): three GEMMs of N × V × H per step instead of four, at the cost of holding
      grad_hidden [N, H] and the float32 weight gradient [V, H] from the forward to the backward.
      Not twice differentiable (a ``create_graph=True`` backward raises).

    Rows are processed ``chunk_rows`` at a time (default by the device, `default_chunk_rows`: about
    2^23 logits per chunk on a CPU, 2^25 when gradients are computed, 256 MiB of logits and at least
    1024 rows on a GPU), so the peak extra memory is O(chunk_rows × V), never O(N × V). The GEMM runs
    in the inputs' dtype (as ``hidden @ weight.T`` would); the logsumexp is float32. Under autocast
    hidden and weight are cast to the autocast dtype first, as F.linear does.
    Raises ValueError/TypeError on bad shapes, dtypes, devices and reductions. The target range is
    checked by the kernels, so that no call reads the targets on the host (a GPU synchronisation): on
    the CPU an out-of-range target is a ValueError naming its index, on CUDA a device-side assert,
    which leaves the CUDA context unusable — the runners validate targets where they build batches.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction != "none":
        total = _summed("linear_cross_entropy", hidden, weight, targets, ignore_index, chunk_rows)
        if reduction == "sum":
            return total
        count = (targets != ignore_index).sum()
        # 0 / 0 = NaN as F.cross_entropy, through `where` so that the gradients are 0, not 0 · inf
        return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))
    gemm_dtype = _check_args("linear_cross_entropy", hidden, weight, targets, chunk_rows)
    if weight.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=hidden.device)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _ = torch.ops.adept_ext.linear_cross_entropy.default(
        hidden, weight, targets, ignore_index,
        chunk_rows or default_chunk_rows(weight.shape[0], hidden.device, gemm_dtype, grad))
    return loss


# How the backward accumulates grad_weight = Σ_chunks dᵀh in float32 without a [V, H] temporary.
WEIGHT_GRAD_PATHS = {
    "float32": "float32 inputs: addmm_ into the float32 gradient",
    "out_dtype": "addmm with out_dtype=float32: the low-precision GEMM accumulates into the float32 gradient",
    "float32_copies": "the chunk's d and h copied to float32, then addmm_ (no out_dtype kernel on this device)",
    "temporary": "a low-precision [V, H] GEMM result added into the float32 gradient (no out_dtype kernel)",
}


@functools.lru_cache(maxsize=None)
def _addmm_out_dtype_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch has a kernel for addmm(..., out_dtype=float32) on `dtype` inputs on the
    device type (CUDA since about torch 2.8; not the CPU in 2.14) that adds into its out= as the
    backward needs (out = out + a·b): tried once on a 2 × 2 problem whose out starts at 1."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        c = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(c.eq(3).all())


def weight_grad_path(device_type: str, dtype: torch.dtype) -> str:
    """The key of `WEIGHT_GRAD_PATHS` the backward takes for inputs of `dtype` on `device_type`."""
    if dtype == torch.float32:
        return "float32"
    if _addmm_out_dtype_runs(device_type, dtype):
        return "out_dtype"
    return "float32_copies" if device_type == "cpu" else "temporary"


def _accumulate_weight_grad(path: str, grad_weight: torch.Tensor, d: torch.Tensor, h: torch.Tensor) -> None:
    if path == "float32":
        grad_weight.addmm_(d.T, h)
    elif path == "out_dtype":
        torch.addmm(grad_weight, d.T, h, out_dtype=torch.float32, out=grad_weight)
    elif path == "float32_copies":
        grad_weight.addmm_(d.T.float(), h.float())
    else:
        grad_weight.add_(d.T @ h)


def _fused_chunks(hidden, weight, targets, ignore_index: int, chunk: int, need_hidden: bool, need_weight: bool,
                  row_stats: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop of the backward and of `linear_cross_entropy_sum`: per chunk of rows, the
    logits z = h Wᵀ in the inputs' dtype; `row_stats(rows, z)` gives each row's float32 (lse, g);
    then one kernel turns z in place into d = g·(exp(z − lse) − onehot(t)) (0 at ignored rows), and
    grad_hidden = d W, grad_weight += dᵀ h in float32 (`weight_grad_path`). Returns (grad_hidden in
    the inputs' dtype, grad_weight in float32); one that is not needed is an empty tensor."""
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden else (0,))
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight \
        else weight.new_empty(0)
    path = weight_grad_path(hidden.device.type, hidden.dtype)
    # the GEMMs in the dtype of the tensors given (the forward's), also when a backward runs under an
    # autocast the forward did not (or the reverse): an autocast GEMM would not match the buffers' dtypes
    with torch.autocast(hidden.device.type, enabled=False):
        for r0 in range(0, hidden.shape[0], chunk):
            rows = slice(r0, r0 + chunk)
            h = hidden[rows]
            d = h @ weight.T
            lse, scale = row_stats(rows, d)
            if need_hidden or need_weight:
                torch.ops.adept_ext.linear_cross_entropy_grad_logits_.default(d, targets[rows], lse, scale,
                                                                              ignore_index)
            if need_hidden:
                torch.mm(d, weight, out=grad_hidden[rows])
            if need_weight:
                _accumulate_weight_grad(path, grad_weight, d, h)
            del d  # before the next chunk's GEMM allocates its own: one chunk of logits at a time
    return grad_hidden, grad_weight


def linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  targets: torch.Tensor, lse: torch.Tensor, ignore_index: int, chunk_rows: int,
                                  need_hidden: bool, need_weight: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of Σ_i grad_loss_i · loss_i, chunk_rows rows at a time (0: `default_chunk_rows`).

    lse: float32 [N], the forward's per-row logsumexp. Each chunk's logits are recomputed and turned
    into their gradient in one pass (`_fused_chunks`). Returns (grad_hidden, grad_weight) in the
    inputs' dtype; one that is not needed is an empty tensor. Peak extra memory O(chunk_rows × V)
    plus the float32 weight gradient.
    """
    chunk = chunk_rows or default_chunk_rows(weight.shape[0], hidden.device, hidden.dtype, grad=True)
    scale, lse = grad_loss.float().contiguous(), lse.contiguous()
    grad_hidden, grad_weight = _fused_chunks(hidden, weight, targets.contiguous(), ignore_index, chunk, need_hidden,
                                             need_weight, lambda rows, logits: (lse[rows], scale[rows]))
    return grad_hidden, grad_weight.to(weight.dtype)


# An op of its own, so that torch.compile traces the backward as one node with a fake impl
# (its fake and the forward's autograd formula are registered below).
linear_cross_entropy_backward_op = torch.library.custom_op(
    "adept_ext::linear_cross_entropy_backward", linear_cross_entropy_backward, mutates_args=())


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """``linear_cross_entropy(..., reduction="sum")``: Σ_i loss_i, float32 scalar, with the gradients
    computed during the forward (the training loss's numerator). Raises as `linear_cross_entropy`."""
    return _summed("linear_cross_entropy_sum", hidden, weight, targets, ignore_index, chunk_rows)


def _summed(name: str, hidden, weight, targets, ignore_index: int, chunk_rows: Optional[int]) -> torch.Tensor:
    """Σ_i loss_i through `linear_cross_entropy_sum_op`: when grad mode is on and hidden or weight
    requires grad, each chunk's logits become their gradient right after their loss (`_fused_chunks`
    with g = 1), and the backward only scales the stored gradients by the incoming scalar. Under
    autocast hidden and weight are cast to the autocast dtype first, as F.linear does."""
    gemm_dtype = _check_args(name, hidden, weight, targets, chunk_rows)
    if weight.shape[0] == 0:
        return torch.zeros((), dtype=torch.float32, device=hidden.device)
    if gemm_dtype != hidden.dtype or gemm_dtype != weight.dtype:  # autocast, as F.linear
        hidden, weight = hidden.to(gemm_dtype), weight.to(gemm_dtype)
    need_hidden = torch.is_grad_enabled() and hidden.requires_grad
    need_weight = torch.is_grad_enabled() and weight.requires_grad
    chunk = chunk_rows or default_chunk_rows(weight.shape[0], hidden.device, gemm_dtype, need_hidden or need_weight)
    total, _, _ = linear_cross_entropy_sum_op(hidden, weight, targets, ignore_index, chunk, need_hidden, need_weight)
    return total


def linear_cross_entropy_sum_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                     ignore_index: int, chunk_rows: int, need_hidden: bool, need_weight: bool
                                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ_i loss_i, ∂/∂hidden, ∂/∂weight in float32) of `linear_cross_entropy_sum`, one pass over the
    chunks; a gradient that is not needed is an empty tensor."""
    targets = targets.contiguous()
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    ones = torch.ones(min(chunk_rows, hidden.shape[0]), dtype=torch.float32, device=hidden.device)

    def row_stats(rows, logits):
        losses[rows], lse = torch.ops.adept_ext.linear_cross_entropy_rows.default(logits, targets[rows],
                                                                                  ignore_index)
        return lse, ones[:logits.shape[0]]

    grad_hidden, grad_weight = _fused_chunks(hidden, weight, targets, ignore_index, chunk_rows, need_hidden,
                                             need_weight, row_stats)
    return losses.sum(), grad_hidden, grad_weight


# An op of its own (traced as one node; its fake and autograd are registered below).
linear_cross_entropy_sum_op = torch.library.custom_op(
    "adept_ext::linear_cross_entropy_sum", linear_cross_entropy_sum_forward, mutates_args=())


# Fakes: the output shapes and dtypes, without computing anything (torch.compile(fullgraph=True)).

@torch.library.register_fake("adept_ext::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, targets, ignore_index, chunk_rows):
    n = hidden.shape[0]
    return hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("adept_ext::linear_cross_entropy_grad_logits_")
def _linear_cross_entropy_grad_logits_fake(logits, targets, lse, grad_loss, ignore_index):
    return None


@torch.library.register_fake("adept_ext::linear_cross_entropy_rows")
def _linear_cross_entropy_rows_fake(logits, targets, ignore_index):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@linear_cross_entropy_sum_op.register_fake
def _linear_cross_entropy_sum_fake(hidden, weight, targets, ignore_index, chunk_rows, need_hidden, need_weight):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,), dtype=torch.float32))


@linear_cross_entropy_backward_op.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, targets, lse, ignore_index, chunk_rows,
                                        need_hidden, need_weight):
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)))


# linear_cross_entropy's autograd: the forward saves its inputs and the per-row logsumexp (no
# logits, no [N, V] buffer); the backward op recomputes one chunk of logits at a time.

def _linear_cross_entropy_setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, chunk_rows = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, targets, lse)
    ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows


def _linear_cross_entropy_grad(ctx, grad_loss, grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = linear_cross_entropy_backward_op(
        grad_loss, hidden, weight, targets, lse, ctx.ignore_index, ctx.chunk_rows, need_hidden, need_weight)
    return (grad_hidden if need_hidden else None), (grad_weight if need_weight else None), None, None, None


torch.library.register_autograd("adept_ext::linear_cross_entropy", _linear_cross_entropy_grad,
                                setup_context=_linear_cross_entropy_setup_context)


# linear_cross_entropy_sum's autograd: the gradients were computed in the forward (for a loss of 1);
# the backward scales them by the incoming scalar.

def _linear_cross_entropy_sum_setup_context(ctx, inputs, output):
    hidden, weight = inputs[:2]
    _, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.dtype = weight.dtype


def _linear_cross_entropy_sum_grad(ctx, grad_total, *unused):
    if torch.is_grad_enabled():  # create_graph=True: the stored gradients are constants
        raise RuntimeError("linear_cross_entropy_sum is not twice differentiable (its gradients are computed "
                           "in the forward); use linear_cross_entropy(...).sum() for a double backward")
    grad_hidden, grad_weight = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    # scaled in place: no second [V, H] gradient at the peak (a second backward through the same graph,
    # retain_graph=True, then raises autograd's "modified by an inplace operation" error)
    return ((_scale_in_float32_(grad_hidden, grad_total) if need_hidden else None),
            (grad_weight.mul_(grad_total).to(ctx.dtype) if need_weight else None), None, None, None, None, None)


def _scale_in_float32_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t *= scale (a float32 scalar tensor) with the product in float32, in place. A bfloat16/float16 t
    goes through a float32 copy of it (transient, [N, H]), on every device: a factor rounded to t's
    dtype would bias every element the same way, by up to 2^-8 = 0.39 % in bfloat16 for scale = 1/N."""
    if t.dtype == torch.float32:
        return t.mul_(scale)
    return t.copy_(t.float().mul_(scale))


linear_cross_entropy_sum_op.register_autograd(_linear_cross_entropy_sum_grad,
                                              setup_context=_linear_cross_entropy_sum_setup_context)


def _register_linear_cross_entropy_autocast(device_type: str) -> None:
    """Under autocast, hidden and weight are cast to the autocast dtype before the op (as
    `F.linear` is), so the forward GEMM, the tensors saved for backward and the backward's
    recomputed logits all use that dtype, wherever `backward()` is called. (Registered by hand
    rather than with `torch.library.register_autocast`, whose cast dtype is fixed: this one
    reads the active autocast dtype, bfloat16 or float16.)"""
    key = torch_internals.autocast_dispatch_key(device_type)
    op = torch.ops.adept_ext.linear_cross_entropy.default

    def kernel(keyset, hidden, weight, targets, ignore_index, chunk_rows):
        dtype = torch.get_autocast_dtype(device_type)
        with torch_internals.excluding_dispatch_key(key):
            return op(hidden.to(dtype), weight.to(dtype), targets, ignore_index, chunk_rows)

    LIB.impl("linear_cross_entropy", kernel, key, with_keyset=True)


for _device_type in ("cpu", "cuda"):
    _register_linear_cross_entropy_autocast(_device_type)
