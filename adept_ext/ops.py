"""Typed wrappers of the compiled ops: argument checks with clear messages, and the fake
(meta) implementations that let the ops trace under torch.compile(fullgraph=True)."""
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from . import _cuda_arch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _detached(tensors):
    """The list itself when no tensor requires grad (the usual case: a detach per tensor costs a
    few microseconds, which add up over hundreds of tensors per call), else detached views. The
    wrappers of the ops that are not differentiable read their tensors through it (see the
    Autograd section at the end of this file)."""
    return [t.detach() for t in tensors] if any(t.requires_grad for t in tensors) else tensors


@functools.lru_cache(maxsize=None)
def _written(op) -> Tuple[int, ...]:
    """Indices of op's Tensor(a!) arguments (the ones it writes)."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _call_as_data(op, *args):
    """op(*args) from the wrapper of an op that is not differentiable, on tensors it detached:
    dispatched below the Python Autograd and ADInplaceOrView kernels registered at the end of this
    file (each boxes every tensor of the lists into Python, tens of µs per call over hundreds of
    tensors), with the written tensors' version counters bumped here instead."""
    if torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        result = op(*args)
    for i in _written(op):
        torch.autograd.graph.increment_version(args[i])
    return result


def _pairs_ok(params, grads):
    """All of _check_tensor_pairs's conditions in one pass without messages (the per-call fast
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


def compiled_cuda_arch_list() -> Optional[str]:
    """The TORCH_CUDA_ARCH_LIST this build's CUDA kernels were compiled for (written by setup.py);
    None for a CPU-only build or a build that predates the record."""
    try:
        from ._build_info import CUDA_ARCH_LIST
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


def _check_tensor_pairs(name: str, params, grads):
    """Validate two parallel tensor lists; returns them as lists (detached) and their common device."""
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"{name}: got {len(params)} params but {len(grads)} grads")
    ok, device = _pairs_ok(params, grads)
    if ok:
        check_device_arch(device)
        return _detached(params), _detached(grads), device
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
    return _detached(params), _detached(grads), device


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
    params, grads, device = _check_tensor_pairs("taylor_importance", params, grads)
    n = len(params)
    if out is None:
        if accumulate:
            raise ValueError("taylor_importance: accumulate=True needs an `out` tensor to add into")
        if n == 0:
            return torch.zeros(0, 2, dtype=torch.float32)
        return _call_as_data(torch.ops.adept_ext.taylor_importance.default, params, grads)
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
        _call_as_data(torch.ops.adept_ext.taylor_importance_out.default, params, grads, out, accumulate)
    return out


@torch.library.register_fake("adept_ext::taylor_importance")
def _taylor_importance_fake(params, grads):
    return params[0].new_empty((len(params), 2), dtype=torch.float32)


@torch.library.register_fake("adept_ext::taylor_importance_out")
def _taylor_importance_out_fake(params, grads, out, accumulate):
    return None


# linear_cross_entropy's default chunking bounds the logits of one chunk, the GEMM's output.
# CPU: 2^23 logits (32 MB in float32; the kernel's own default, sized for 2 cores' caches).
# GPU: 256 MiB of logits in the GEMM's dtype and at least 1024 rows: a 2^23-logit chunk is 65 rows
# at V = 128k, which made every GEMM tiny on an H200 (43 ms vs 8.3 ms at 1024 rows, issue 11).
CPU_CHUNK_LOGITS = 1 << 23
GPU_CHUNK_BYTES = 256 << 20
GPU_MIN_CHUNK_ROWS = 1024


def default_chunk_rows(vocab: int, device: torch.device, dtype: torch.dtype) -> int:
    """Rows per chunk that `linear_cross_entropy` uses when `chunk_rows` is None (see above)."""
    vocab = max(int(vocab), 1)
    if torch.device(device).type == "cpu":
        return max(1, CPU_CHUNK_LOGITS // vocab)
    rows = GPU_CHUNK_BYTES // (vocab * dtype.itemsize)
    return max(GPU_MIN_CHUNK_ROWS, rows // 128 * 128)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Per-row cross-entropy of the logits hidden @ weight.T, without materialising them (docs/methods.md §1.1).

    hidden [N, H] and weight [V, H] (float32, bfloat16 or float16, same dtype and device),
    targets [N] int64 in [0, V) or ``ignore_index``. Returns float32 [N]:
    loss_i = logsumexp_v(h_i·w_v) − h_i·w_{t_i}, and 0 at ignored rows. Rows are processed
    ``chunk_rows`` at a time (default by the device, `default_chunk_rows`: about 2^23 logits per
    chunk on a CPU, 256 MiB of logits and at least 1024 rows on a GPU), so the peak extra memory
    is O(chunk_rows × V), never O(N × V). The GEMM runs in the inputs' dtype (as
    ``hidden @ weight.T`` would); the logsumexp is float32.
    Differentiable with respect to hidden and weight (see `linear_cross_entropy_backward`: the
    backward recomputes one chunk of logits at a time, so it never holds [N, V] either).
    Raises ValueError/TypeError on bad shapes, dtypes, devices and out-of-range targets. Under
    torch.compile the target range is not checked here (the check reads the targets on the host,
    which would break the graph): an out-of-range target then stops the kernel itself, as a
    RuntimeError on the CPU and a device-side assert on CUDA, which leaves the CUDA context unusable.
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
    autocast = torch.is_autocast_enabled(hidden.device.type)  # both are cast to the autocast dtype (below)
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
    if weight.shape[0] == 0:
        if hidden.shape[0] == 0:
            return torch.zeros(0, dtype=torch.float32, device=hidden.device)
        raise ValueError(f"{name}: weight has no rows (vocabulary of size 0)")
    if not torch.compiler.is_compiling():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{name}: targets[{i}] = {int(targets[i])} is outside [0, {weight.shape[0]}) "
                             f"and is not ignore_index ({ignore_index})")
    check_device_arch(hidden.device)
    gemm_dtype = torch.get_autocast_dtype(hidden.device.type) if autocast else hidden.dtype
    return torch.ops.adept_ext.linear_cross_entropy.default(
        hidden, weight, targets, ignore_index,
        chunk_rows or default_chunk_rows(weight.shape[0], hidden.device, gemm_dtype))


@torch.library.register_fake("adept_ext::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, targets, ignore_index, chunk_rows):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


def linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  targets: torch.Tensor, ignore_index: int, chunk_rows: int,
                                  need_hidden: bool, need_weight: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of Σ_i grad_loss_i · loss_i, chunk_rows rows at a time (0: `default_chunk_rows`).

    Per chunk the logits z = h Wᵀ are recomputed in the inputs' dtype and
    D = grad_loss[:, None] · (softmax(z) − onehot(t)) is formed in float32 (0 at ignored rows);
    then grad_hidden = D W and grad_weight = Σ_chunks Dᵀ h (D cast to the inputs' dtype for both
    GEMMs, grad_weight summed in float32). Returns (grad_hidden, grad_weight) in the inputs'
    dtype; one that is not needed is an empty tensor. Peak extra memory O(chunk_rows × V).
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = chunk_rows or default_chunk_rows(vocab, hidden.device, hidden.dtype)
    ignored = targets == ignore_index
    scale = grad_loss.float()
    safe_targets = targets.masked_fill(ignored, 0)
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden else (0,))
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight \
        else weight.new_empty(0)
    for r0 in range(0, n, chunk):
        h = hidden[r0:r0 + chunk]
        d = torch.softmax(h @ weight.T, dim=1, dtype=torch.float32)
        d[torch.arange(h.shape[0], device=d.device), safe_targets[r0:r0 + chunk]] -= 1
        d = d.mul_(scale[r0:r0 + chunk, None]).masked_fill_(ignored[r0:r0 + chunk, None], 0).to(hidden.dtype)
        if need_hidden:
            torch.mm(d, weight, out=grad_hidden[r0:r0 + chunk])
        if need_weight and d.dtype == torch.float32:
            grad_weight.addmm_(d.T, h)
        elif need_weight:  # a bfloat16/float16 GEMM per chunk, summed in float32
            grad_weight.add_(d.T @ h)
    return grad_hidden, grad_weight.to(weight.dtype)


# An op of its own, so that torch.compile traces the backward as one node with a fake impl.
_linear_cross_entropy_backward_op = torch.library.custom_op(
    "adept_ext::linear_cross_entropy_backward", linear_cross_entropy_backward, mutates_args=())


@_linear_cross_entropy_backward_op.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, targets, ignore_index, chunk_rows,
                                        need_hidden, need_weight):
    return (hidden.new_empty(hidden.shape if need_hidden else (0,)),
            weight.new_empty(weight.shape if need_weight else (0,)))


def _linear_cross_entropy_setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, chunk_rows = inputs
    ctx.save_for_backward(hidden, weight, targets)  # no logits and no [N, V] buffer: recomputed per chunk
    ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows


def _linear_cross_entropy_grad(ctx, grad_loss):
    hidden, weight, targets = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = _linear_cross_entropy_backward_op(
        grad_loss, hidden, weight, targets, ctx.ignore_index, ctx.chunk_rows, need_hidden, need_weight)
    return (grad_hidden if need_hidden else None), (grad_weight if need_weight else None), None, None, None


torch.library.register_autograd("adept_ext::linear_cross_entropy", _linear_cross_entropy_grad,
                                setup_context=_linear_cross_entropy_setup_context)


def _register_linear_cross_entropy_autocast(device_type: str) -> None:
    """Under autocast, hidden and weight are cast to the autocast dtype before the op (as
    `F.linear` is), so the forward GEMM, the tensors saved for backward and the backward's
    recomputed logits all use that dtype, wherever `backward()` is called. (Registered by hand
    rather than with `torch.library.register_autocast`, whose cast dtype is fixed: this one
    reads the active autocast dtype, bfloat16 or float16.)"""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    op = torch.ops.adept_ext.linear_cross_entropy.default

    def kernel(keyset, hidden, weight, targets, ignore_index, chunk_rows):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(hidden.to(dtype), weight.to(dtype), targets, ignore_index, chunk_rows)

    _LIB.impl("linear_cross_entropy", kernel, key, with_keyset=True)


BASIS_DTYPES = (torch.float32, torch.bfloat16)


def _check_tensor_list(name: str, label: str, tensors, device, dtypes=SUPPORTED_DTYPES, contiguous=False):
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
    """All of _check_basis's conditions in one pass without messages: the per-call fast path."""
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


def _check_basis(name: str, basis, grads, in_place: bool):
    basis, grads = list(basis), list(grads)
    if len(basis) != len(grads):
        raise ValueError(f"{name}: got {len(basis)} basis tensors but {len(grads)} grads")
    if not basis:
        raise ValueError(f"{name}: empty tensor lists")
    if _basis_ok(basis, grads, in_place):
        check_device_arch(basis[0].device)
        return basis, grads, basis[0].shape[0]
    device = basis[0].device if isinstance(basis[0], torch.Tensor) else None
    basis = _check_tensor_list(name, "basis", basis, device, BASIS_DTYPES)
    grads = _check_tensor_list(name, "grads", grads, device, contiguous=in_place)
    k = basis[0].shape[0] if basis[0].dim() else None
    for i, (q, g) in enumerate(zip(basis, grads)):
        if q.dim() != g.dim() + 1 or q.shape[0] != k or q.shape[1:] != g.shape:
            raise ValueError(f"{name}: basis[{i}] has shape {tuple(q.shape)}; expected ({k}, *{tuple(g.shape)}) "
                             "with the same k for every tensor")
    check_device_arch(device)
    return basis, grads, k


def null_space_coeffs(basis: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """c = Qᵀg over a list of tensors (EoupCT null-space projection, docs/methods.md §2).

    basis[i] is [k, *grads[i].shape] (float32 or bfloat16): row j is tensor i's slice of basis
    vector j. grads: float32/bfloat16/float16, and the dtypes may differ across the list. Returns
    float64 [k] with c_j = Σ_i ⟨basis_i[j], grads_i⟩, accumulated in float32 per 8192-element chunk
    and float64 across chunks in a fixed order (deterministic). Any k: no kernel keeps k values in
    shared memory (the CUDA kernels hold the coefficients in registers, 8 at a time).
    Not differentiable: the tensors are read as data (detached); the result never requires grad.
    """
    basis, grads, _ = _check_basis("null_space_coeffs", basis, grads, in_place=False)
    return null_space_coeffs_prechecked(basis, grads)


def null_space_coeffs_prechecked(basis: List[torch.Tensor], grads: List[torch.Tensor]) -> torch.Tensor:
    """`null_space_coeffs` without its per-tensor checks, for lists whose every condition the
    caller has already checked (projection.GradientMemory checks a direction once per call; the
    checks cost more host time over hundreds of tensors than the kernels take on a GPU at mid sizes)."""
    return _call_as_data(torch.ops.adept_ext.null_space_coeffs.default, _detached(basis), _detached(grads))


def null_space_apply_(basis: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], coeffs: torch.Tensor) -> None:
    """In place, grads_i ← grads_i − Σ_j coeffs_j · basis_i[j] (g ← g − Q c, docs/methods.md §2).
    coeffs: float64 [k] on the tensors' device; grads must be contiguous. Not differentiable: the
    tensors are updated as data (as an optimizer step updates parameters, also ones that require
    grad); their version counters are bumped, so a tensor saved for backward and then changed here
    makes that backward raise."""
    basis, grads, k = _check_basis("null_space_apply_", basis, grads, in_place=True)
    if not isinstance(coeffs, torch.Tensor) or coeffs.dtype != torch.float64 or tuple(coeffs.shape) != (k,):
        raise ValueError(f"null_space_apply_: coeffs must be a float64 tensor of shape ({k},)")
    if coeffs.device != grads[0].device:
        raise ValueError(f"null_space_apply_: coeffs is on {coeffs.device}, the tensors on {grads[0].device}")
    null_space_apply_prechecked_(basis, grads, coeffs)


def null_space_apply_prechecked_(basis: List[torch.Tensor], grads: List[torch.Tensor], coeffs: torch.Tensor) -> None:
    """`null_space_apply_` without its per-tensor checks (see `null_space_coeffs_prechecked`)."""
    _call_as_data(torch.ops.adept_ext.null_space_apply_.default, _detached(basis), _detached(grads), coeffs)


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
    g_new = _check_tensor_list(name, "g_new", g_new, device, contiguous=True)
    g_pre = _check_tensor_list(name, "g_pre", g_pre, device)
    check_device_arch(device)
    for i, (a, b) in enumerate(zip(g_new, g_pre)):
        if a.shape != b.shape:
            raise ValueError(f"{name}: g_new[{i}] has shape {tuple(a.shape)} but g_pre[{i}] has {tuple(b.shape)}")
    if eps < 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    return _call_as_data(torch.ops.adept_ext.conflict_correct_.default, _detached(g_new), _detached(g_pre),
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


# Autograd of the ops that are not differentiable. Their results are statistics of parameters and
# gradients (Taylor sums, projection coefficients) or in-place updates of them, so there is no
# gradient to give, and a silent None (PyTorch's default for an op without a formula) would hide
# the mistake. The raw ops therefore raise: the functional ones when a backward reaches them, the
# in-place ones when they are called on a tensor that requires grad with grad mode on. The
# wrappers above read their inputs as data (detached: the results never require grad, and the
# in-place ones update their tensors as an optimizer step does). The in-place ops bump the version
# counters of the tensors they write (also through the wrappers' detached aliases, which share
# them), so autograd detects a tensor that was saved for backward and then changed.
_LIB = torch.library.Library("adept_ext", "IMPL")
NOT_DIFFERENTIABLE = {
    "taylor_importance": "Taylor importance sums are statistics of parameters and gradients",
    "null_space_coeffs": "projection coefficients of gradients have no gradient of their own",
    "taylor_importance_out": "Taylor importance sums are statistics of parameters and gradients",
    "null_space_apply_": "it updates gradients or parameters in place, as an optimizer step does",
    "conflict_correct_": "it updates gradients in place, as an optimizer step does",
}


def _not_differentiable(name: str) -> RuntimeError:
    return RuntimeError(
        f"adept_ext.{name} is not differentiable ({NOT_DIFFERENTIABLE[name]}): call it on detached "
        "tensors or under torch.no_grad(), as the adept_ext.ops wrapper does")


def _register_not_differentiable(name: str) -> None:
    op = getattr(torch.ops.adept_ext, name).default
    written = _written(op)
    if not written:  # functional: the result may require grad, a backward through it raises
        def backward(ctx, *grads):
            raise _not_differentiable(name)

        torch.library.register_autograd(op, backward, lib=_LIB)
        return

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            raise _not_differentiable(name)
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    def version_bump_kernel(keyset, *args):
        for i in written:
            torch.autograd.graph.increment_version(args[i])
        return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _LIB.impl(name, version_bump_kernel, "ADInplaceOrView", with_keyset=True)


for _name in NOT_DIFFERENTIABLE:
    _register_not_differentiable(_name)

for _device_type in ("cpu", "cuda"):
    _register_linear_cross_entropy_autocast(_device_type)
