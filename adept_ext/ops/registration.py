"""What every compiled op's module shares: `LIB`, the library its Python kernels are registered in,
`call_as_data` for the wrappers of the ops that are not differentiable, and those ops' autograd (a
clear error instead of PyTorch's silent None). Each op's own fake, autograd formula and autocast rule
live beside its wrapper (`taylor`, `null_space`, `cross_entropy`); the private dispatcher APIs are
in `torch_internals`."""
import torch

from . import torch_internals

LIB = torch.library.Library("adept_ext", "IMPL")


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

        torch.library.register_autograd(op, backward, lib=LIB)
        return

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch_internals.any_requires_grad(*args):
            raise _not_differentiable(name)
        return torch_internals.redispatch_after_autograd(op, keyset, *args)

    def version_bump_kernel(keyset, *args):
        for i in written:
            torch.autograd.graph.increment_version(args[i])
        return torch_internals.redispatch_after_inplace_view(op, keyset, *args)

    LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    LIB.impl(name, version_bump_kernel, "ADInplaceOrView", with_keyset=True)


for _name in NOT_DIFFERENTIABLE:
    _register_not_differentiable(_name)
