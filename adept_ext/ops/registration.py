"""What the compiled ops need besides their kernels: fake (meta) implementations, so they trace
under torch.compile(fullgraph=True); autograd (linear_cross_entropy's formula, and a clear error
for the ops that have none); and linear_cross_entropy's autocast behaviour. Imported once by
`adept_ext.ops`; the private dispatcher APIs it needs are in `torch_internals`."""
import torch

from . import torch_internals
from .cross_entropy import linear_cross_entropy_backward_op, linear_cross_entropy_sum_op

_LIB = torch.library.Library("adept_ext", "IMPL")


def call_as_data(op, *args):
    """op(*args) from the wrapper of an op that is not differentiable, on tensors it detached:
    dispatched below the Python Autograd and ADInplaceOrView kernels registered below (each boxes
    every tensor of the lists into Python, tens of µs per call over hundreds of tensors), with the
    written tensors' version counters bumped here instead."""
    if torch.compiler.is_compiling():
        return op(*args)
    with torch_internals.below_autograd():
        result = op(*args)
    for i in torch_internals.written_arguments(op):
        torch.autograd.graph.increment_version(args[i])
    return result


# Fakes: the output shapes and dtypes of each op, without computing anything.

@torch.library.register_fake("adept_ext::taylor_importance")
def _taylor_importance_fake(params, grads):
    return params[0].new_empty((len(params), 2), dtype=torch.float32)


@torch.library.register_fake("adept_ext::taylor_importance_out")
def _taylor_importance_out_fake(params, grads, out, accumulate):
    return None


@torch.library.register_fake("adept_ext::null_space_coeffs")
def _null_space_coeffs_fake(basis, grads):
    return grads[0].new_empty((basis[0].shape[0],), dtype=torch.float64)


@torch.library.register_fake("adept_ext::null_space_apply_")
def _null_space_apply_fake(basis, grads, coeffs):
    return None


@torch.library.register_fake("adept_ext::conflict_correct_")
def _conflict_correct_fake(g_new, g_pre, lam, eps):
    return g_new[0].new_empty((4,), dtype=torch.float64)


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

    _LIB.impl("linear_cross_entropy", kernel, key, with_keyset=True)


# Autograd of the ops that are not differentiable. Their results are statistics of parameters and
# gradients (Taylor sums, projection coefficients) or in-place updates of them, so there is no
# gradient to give, and a silent None (PyTorch's default for an op without a formula) would hide
# the mistake. The raw ops therefore raise: the functional ones when a backward reaches them, the
# in-place ones when they are called on a tensor that requires grad with grad mode on. The
# wrappers read their inputs as data (detached: the results never require grad, and the in-place
# ones update their tensors as an optimizer step does). The in-place ops bump the version counters
# of the tensors they write (also through the wrappers' detached aliases, which share them), so
# autograd detects a tensor that was saved for backward and then changed.
NOT_DIFFERENTIABLE = {
    "taylor_importance": "Taylor importance sums are statistics of parameters and gradients",
    "null_space_coeffs": "projection coefficients of gradients have no gradient of their own",
    "taylor_importance_out": "Taylor importance sums are statistics of parameters and gradients",
    "null_space_apply_": "it updates gradients or parameters in place, as an optimizer step does",
    "conflict_correct_": "it updates gradients in place, as an optimizer step does",
    "linear_cross_entropy_grad_logits_": "it is a step of linear_cross_entropy's backward, in place on logits",
}


def _not_differentiable(name: str) -> RuntimeError:
    return RuntimeError(
        f"adept_ext.{name} is not differentiable ({NOT_DIFFERENTIABLE[name]}): call it on detached "
        "tensors or under torch.no_grad(), as the adept_ext.ops wrapper does")


def _register_not_differentiable(name: str) -> None:
    op = getattr(torch.ops.adept_ext, name).default
    written = torch_internals.written_arguments(op)
    if not written:  # functional: the result may require grad, a backward through it raises
        def backward(ctx, *grads):
            raise _not_differentiable(name)

        torch.library.register_autograd(op, backward, lib=_LIB)
        return

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch_internals.any_requires_grad(*args):
            raise _not_differentiable(name)
        return torch_internals.redispatch_after_autograd(op, keyset, *args)

    def version_bump_kernel(keyset, *args):
        for i in written:
            torch.autograd.graph.increment_version(args[i])
        return torch_internals.redispatch_after_inplace_view(op, keyset, *args)

    _LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _LIB.impl(name, version_bump_kernel, "ADInplaceOrView", with_keyset=True)


for _name in NOT_DIFFERENTIABLE:
    _register_not_differentiable(_name)

for _device_type in ("cpu", "cuda"):
    _register_linear_cross_entropy_autocast(_device_type)
