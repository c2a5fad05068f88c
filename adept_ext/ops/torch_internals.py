"""Every private PyTorch API adept_ext uses, in one place, each with the torch versions it was
checked on. Nothing else in the package touches a `torch._*` name that is not a documented
`torch._foreach_*` op.

Checked on: 2.14.1 (CI: the whole suite). The GPU machine's 2.11.0+cu130 ran the CUDA kernels once
(2026-11-30), before these helpers existed in this form: nothing here is known to run on 2.11 until
the next GPU check (tools/gpu_check.sh) imports the package there.
"""
import functools
import importlib
from typing import Tuple

import torch

# major.minor of the torch versions above; defined beside the build's decisions, which setup.py and
# `import adept_ext` read before the compiled library exists or is loaded (a torch outside it is refused).
from .._cuda_arch import TESTED_TORCH  # noqa: F401


@functools.lru_cache(maxsize=None)
def written_arguments(op) -> Tuple[int, ...]:
    """Indices of op's `Tensor(a!)` arguments (the ones it writes), from its schema."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def below_autograd():
    """A context that dispatches below the Autograd and ADInplaceOrView kernels."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def has_kernel(op_name: str, dispatch_key: str) -> bool:
    """Whether `op_name` ("namespace::name") has a kernel registered for `dispatch_key` ("CUDA")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dispatch_key)


def any_requires_grad(*args) -> bool:
    """Whether any tensor in args (also inside lists) requires grad."""
    return torch._C._any_requires_grad(*args)


def redispatch_after_autograd(op, keyset, *args):
    """op(*args) from an Autograd kernel registered with `with_keyset=True`, on the next key."""
    return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def redispatch_after_inplace_view(op, keyset, *args):
    """op(*args) from an ADInplaceOrView kernel registered with `with_keyset=True`, on the next key."""
    return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)


def autocast_dispatch_key(device_type: str) -> str:
    """The name of the Autocast dispatch key of a device type ("cpu" -> "AutocastCPU")."""
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def excluding_dispatch_key(key: str):
    """A context in which the dispatch key `key` (a name) is skipped."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))


def uncompile_module(module: torch.nn.Module) -> None:
    """Undo `nn.Module.compile` (which keeps the compiled callable in `_compiled_call_impl`)."""
    module._compiled_call_impl = None


def group_tensors_by_device_and_dtype(tensorlists, with_indices: bool = False):
    """`torch.optim.Optimizer`'s grouping of parallel tensor lists for the `_foreach` kernels."""
    return torch.optim.Optimizer._group_tensors_by_device_and_dtype(tensorlists, with_indices=with_indices)


def undo_fully_shard(model: torch.nn.Module) -> torch.nn.Module:
    """Take back what FSDP2's `fully_shard` added to `model` (in place): whole plain parameters
    on every rank (tied ones stay tied), its hooks, state and classes removed. FSDP2 has no public
    inverse of `fully_shard`; a collective when any parameter is sharded."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    contract = importlib.import_module("torch.distributed._composable.contract")
    whole = {}
    for module in model.modules():
        for p in module._parameters.values():
            if isinstance(p, DTensor) and id(p) not in whole:
                whole[id(p)] = torch.nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in whole:
                module._parameters[name] = whole[id(p)]
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(attr, None)
        if not isinstance(module, FSDPModule):
            continue
        state = fully_shard.state(module)
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param._post_load_hook_handle.remove()
            for handle in (*group._module_to_pre_save_state_dict_hook_handle.values(),
                           *group._module_to_pre_load_state_dict_hook_handle.values()):
                handle.remove()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        for key in (contract.STATE_KEY, contract.REGISTRY_KEY):
            module.__dict__.pop(key, None)
        _module_state_mapping.pop(module, None)
        module.__class__ = type(module).__mro__[type(module)._orig_cls_mro_index]
    return model
