"""AdamW over many param groups in one multi-tensor pass (issue: per-unit groups cost a step).

ADEPT Stage 2 gives every unit its own param group (`lr.param_groups`), so that each gets its
own learning rate. `torch.optim.AdamW` then runs its multi-tensor (foreach) kernels once per
group: on a GPU, about 8 kernel launches per group per step, 350 for 44 units, which the first
H200 run measured at +1.3 % of a Qwen3-0.6B-shaped step. `GroupedAdamW` takes the same groups
and the same state, but updates every group's tensors together with torch's own `_foreach_*`
kernels, each tensor with its group's learning rate and weight decay as a per-tensor scalar:

    θ ← θ·(1 − lr_g·λ_g);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
    θ ← θ − lr_g / (1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

(Loshchilov & Hutter, "Decoupled Weight Decay Regularization", Alg. 2; torch.optim.AdamW's
arithmetic, step for step, so the result is bit-identical to it — tested.) The group learning
rates are read at each step, so schedulers and `DecoupledLR`'s multipliers work as with AdamW.
Every group must share betas and eps; amsgrad, maximize, capturable, differentiable and fused
modes, Adam's L2 decay and complex parameters are not offered (a clear error, also when loading
a state dict, never a silent change of arithmetic).

`make_optimizer` builds the optimizer a run names with Hugging Face's `optim` values (transformers'
`OptimizerNames`): `adamw_torch` is `GroupedAdamW`; `adamw_8bit` (HF's alias `adamw_bnb_8bit`) and
`paged_adamw_8bit` are bitsandbytes' blockwise 8-bit AdamW (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", 2022; docs/design.md, "Precision"): the same AdamW arithmetic (decoupled
decay, bias corrections, eps outside the square root), its two moments held as uint8 codes of a
dynamic map with one float32 scale per block of 256 elements, about 2 bytes per parameter instead of 8.
It reads every group's lr and weight decay at each step and runs the optimizer's step hooks, so
schedulers and ADEPT's per-unit rates (`lr.DecoupledLR`) apply as with AdamW (tested).
"""
import importlib.util
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from .errors import RunError
from .ops.torch_internals import group_tensors_by_device_and_dtype

# Hugging Face's `optim` names this module builds (transformers.training_args.OptimizerNames).
OPTIMIZERS = ("adamw_torch", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit")
BNB_MODULE = "bitsandbytes"
BNB_INSTALL = "pip install 'adept-ext[quantization]'"
# bitsandbytes' and HF's default: a tensor of fewer elements keeps float32 moments (little to save).
MIN_8BIT_SIZE = 4096
BLOCK = 256  # elements per float32 scale of bitsandbytes' blockwise 8-bit moments


STEP_SLICE_NUMEL = 2**25  # elements GroupedAdamW updates in one multi-tensor pass (`_passes`): its √v, 128 MiB


def moment_bytes(name: str) -> float:
    """Bytes of optimizer state per trainable parameter of a large tensor under `name`: two float32
    moments (8), or two uint8 moments and their two float32 scales per `BLOCK` (2 + 8/256), not
    counting bitsandbytes' two 256-entry maps (2 KiB per device) nor the float32 moments of tensors
    under `MIN_8BIT_SIZE` and of the embedding weights (`make_optimizer`'s `keep_float32`)."""
    return 8.0 if name == "adamw_torch" else 2 + 2 * 4 / BLOCK


def step_bytes(name: str, trainable: int) -> int:
    """Bytes an optimizer step of `trainable` parameters allocates beside its state: GroupedAdamW's
    temporary √v, one pass of at most `STEP_SLICE_NUMEL` elements in float32 (a larger tensor is cut
    into passes; trainable parameters are contiguous); nothing for bitsandbytes' 8-bit update, fused
    in one kernel per tensor."""
    return 4 * min(trainable, STEP_SLICE_NUMEL) if name == "adamw_torch" else 0


def check_optimizer(name: str, sharded: bool = False):
    """RunError for an optimizer `make_optimizer` does not build, an 8-bit one without bitsandbytes
    installed, or an 8-bit one for FSDP2 (`sharded`): bitsandbytes' update is a custom op with no
    DTensor rule, so it cannot step the shards ("got mixed torch.Tensor and DTensor")."""
    if name not in OPTIMIZERS:
        raise RunError(f"optim must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    if name == "adamw_torch":
        return
    if importlib.util.find_spec(BNB_MODULE) is None:
        raise RunError(f"--optim {name} is bitsandbytes' 8-bit AdamW, which is not installed: {BNB_INSTALL}")
    if sharded:
        raise RunError(f"--optim {name} with --parallel fsdp2 is not supported: bitsandbytes' 8-bit update cannot "
                       "step FSDP2's sharded (DTensor) parameters; use --parallel ddp, or --optim adamw_torch")


def make_optimizer(name: str, param_groups, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8,
                   keep_float32: Iterable[torch.Tensor] = ()) -> torch.optim.Optimizer:
    """The optimizer `name` (one of `OPTIMIZERS`, `check_optimizer`) over `param_groups`, each group's
    own lr and weight decay honoured: `GroupedAdamW`, or bitsandbytes' `AdamW8bit` / `PagedAdamW8bit`
    (module docstring) whose parameters in `keep_float32` (Hugging Face's Trainer: the embedding
    weights, whose 8-bit moments are unstable) and those under `MIN_8BIT_SIZE` elements keep float32
    moments. Paged state pages only on a GPU (bitsandbytes falls back to plain tensors on the CPU,
    with a warning). RunError as `check_optimizer`."""
    check_optimizer(name)
    if name == "adamw_torch":
        return GroupedAdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    from bitsandbytes.optim import AdamW8bit, PagedAdamW8bit

    keep = {id(p) for p in keep_float32}

    class BnbAdamW(PagedAdamW8bit if name.startswith("paged_") else AdamW8bit):
        def get_config(self, gindex, pindex, group):  # optim_bits: read when a tensor's state is made
            config = super().get_config(gindex, pindex, group)
            if id(group["params"][pindex]) in keep:
                config["optim_bits"] = 32
            return config

    BnbAdamW.__name__ = BnbAdamW.__qualname__ = "Paged" * name.startswith("paged_") + "AdamW8bit"
    return BnbAdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` (moments, 8-bit codes, block scales; a tensor
    several parameters share, as bitsandbytes' quantisation maps, counted once)."""
    seen = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[(value.untyped_storage().data_ptr(), value.device)] = value.untyped_storage().nbytes()
    return sum(seen.values())


class GroupedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose `step` updates all param groups in one multi-tensor pass per
    (device, dtype), with per-tensor learning rates and weight decays (module docstring). Its
    state and `state_dict` are AdamW's: a checkpoint of one loads into the other."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1], len(self.param_groups) - 1, self.param_groups[0])
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise

    def load_state_dict(self, state_dict):
        """AdamW's state dict (of this class or of torch.optim.AdamW); its groups are checked
        first, so one with settings GroupedAdamW does not implement is refused unloaded."""
        groups = state_dict["param_groups"]
        for i, group in enumerate(groups):
            _check_group(group, i, groups[0], params_known=False)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: List[torch.Tensor] = []
        grads, exp_avgs, exp_avg_sqs, steps, lrs, decays = [], [], [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GroupedAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:  # AdamW's own initial state
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                lrs.append(group["lr"])
                decays.append(group["weight_decay"])
        if params:
            beta1, beta2 = self.param_groups[0]["betas"]
            eps = self.param_groups[0]["eps"]
            grouped = group_tensors_by_device_and_dtype([params, grads, exp_avgs, exp_avg_sqs, steps],
                                                        with_indices=True)
            for (p, g, m, v, t), indices in grouped.values():
                counts = _count_steps(t)
                rates, decay = [lrs[i] for i in indices], [decays[i] for i in indices]
                lists = (p, g, m, v)
                whole = [not all(x[i].is_contiguous() for x in lists) for i in range(len(p))]
                for pieces in _passes([x.numel() for x in p], STEP_SLICE_NUMEL, whole):  # its temporary √v: one pass
                    _adamw_update(*(_cut(x, pieces) for x in lists), [rates[i] for i, _, _ in pieces],
                                  [decay[i] for i, _, _ in pieces], [counts[i] for i, _, _ in pieces],
                                  beta1, beta2, eps)
        return loss


def _passes(sizes: List[int], numel: int, whole: List[bool]) -> List[List[Tuple[int, int, int]]]:
    """The multi-tensor passes of an update: lists of (tensor index, first element, end element) of
    at most `numel` elements each, in order; a larger tensor is cut along its flat view into pieces
    of `numel`, unless `whole[i]` (not contiguous: then it is a pass of its own)."""
    passes, current, size = [], [], 0
    for i, n in enumerate(sizes):
        step = max(n, 1) if whole[i] else numel
        for first in range(0, max(n, 1), step):
            end = min(first + step, n)
            if current and size + end - first > numel:
                passes.append(current)
                current, size = [], 0
            current.append((i, first, end))
            size += end - first
    return passes + [current] if current else passes


def _cut(tensors: List[torch.Tensor], pieces: List[Tuple[int, int, int]]) -> List[torch.Tensor]:
    """The pieces (`_passes`) of `tensors`: a whole tensor, or a range of its flat view."""
    return [tensors[i] if (first, end) == (0, tensors[i].numel()) else tensors[i].view(-1)[first:end]
            for i, first, end in pieces]


def _check_group(group, i: int, first, params_known: bool = True):
    """ValueError for a param group GroupedAdamW cannot step as AdamW does."""
    for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
        if group.get(flag):
            raise ValueError(f"GroupedAdamW: param group {i} sets {flag}=True, which it does not implement; "
                             "use torch.optim.AdamW")
    if group.get("decoupled_weight_decay") is False:
        raise ValueError(f"GroupedAdamW: param group {i} is Adam's (L2 weight decay), not AdamW's")
    if tuple(group["betas"]) != tuple(first["betas"]) or group["eps"] != first["eps"]:
        raise ValueError(f"GroupedAdamW: param group {i} has betas {group['betas']} / eps {group['eps']}, "
                         f"group 0 {first['betas']} / {first['eps']}: every group must share them")
    if isinstance(group["lr"], torch.Tensor):
        raise ValueError(f"GroupedAdamW: param group {i} has a tensor lr; give a float")
    if params_known and any(torch.is_complex(p) for p in group["params"]):
        raise ValueError(f"GroupedAdamW: param group {i} has complex parameters; use torch.optim.AdamW")


def _count_steps(steps) -> List[float]:
    """AdamW's step counters of one device's tensors, each one more (as AdamW adds it), as floats."""
    if steps[0].is_cpu:  # where AdamW keeps them: one CPU scalar for the whole list, as AdamW adds it
        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1)
    return [float(t) for t in steps]  # on the CPU (where AdamW keeps them): no device sync


def _adamw_update(params, grads, exp_avgs, exp_avg_sqs, lrs, decays, counts, beta1, beta2, eps):
    """One AdamW update of tensors of one device and dtype (or pieces of them) at step `counts`, in
    torch.optim.AdamW's order of operations (torch/optim/adam.py, `_multi_tensor_adam`), with
    per-tensor lr and decay."""
    if any(d != 0 for d in decays):
        torch._foreach_mul_(params, [1 - lr * d for lr, d in zip(lrs, decays)])
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_sizes = [(lr / (1 - beta1 ** n)) * -1 for lr, n in zip(lrs, counts)]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - beta2 ** n) ** 0.5 for n in counts])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)
