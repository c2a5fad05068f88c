"""Frozen linear weights held in 4 bits during a task: `--frozen-dtype nf4` (docs/design.md, "Precision").

QLoRA's data type (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", NeurIPS 2023:
4-bit NormalFloat, double quantisation) through bitsandbytes: `hold_nf4` replaces every frozen
`nn.Linear` of the decoder layers (LoRA's base layers, ADEPT's and LLaMA-Pro's originals, freeze_deep's deep block) by a
`bitsandbytes.nn.Linear4bit` holding its weight as NF4 in blocks of 64 with double quantisation (the
blocks' scales quantised too: about 0.52 bytes a weight), computing in `compute_dtype`, quantised
from the exact weight (`held.exact_value`: not its bfloat16 copy where the load held it). The
replaced layer moves to the host, and `release_nf4` puts it back, so what follows the steps
(merging, saving) sees the weights the task started from, bit for bit. What trains, the norms, the
embeddings and the LM head are not touched here (`training.device.hold_frozen` holds them). Linear
layers are the whole of it: a mixture of experts' fused expert tensors stay as they are.
"""
import importlib.util
from typing import Dict, List, Tuple

import torch

from . import held
from ..errors import RunError
from .families import adapter
from ..optim import BNB_INSTALL, BNB_MODULE

QUANT_TYPE, BLOCKSIZE = "nf4", 64
_HELD = "_adept_nf4_originals"  # model.__dict__ entry: {module name: the exact nn.Linear}, not a submodule


MISSING = f"--frozen-dtype nf4 needs bitsandbytes, which is not installed: {BNB_INSTALL}"


def check_installed():
    """RunError where bitsandbytes is not installed, found without importing it (the options' check)."""
    if importlib.util.find_spec(BNB_MODULE) is None:
        raise RunError(MISSING)


def bitsandbytes():
    """The bitsandbytes module; RunError naming the extra to install where it is missing."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise RunError(MISSING) from e
    return bnb


def frozen_linears(model) -> List[Tuple[str, torch.nn.Linear]]:
    """(name in `model`, module) of every plain `nn.Linear` inside the decoder layers, not an adapter's
    own factor (PEFT's `lora_A`/`lora_B`), none of whose parameters trains and whose rows are whole
    blocks (`in_features` a multiple of 64, as every hidden and intermediate size of the supported
    models is): bitsandbytes 0.50's CPU quantiser
    rounds other shapes with up to three times NF4's error (measured: 32 x 32 at 0.33 of the largest
    weight, against 0.09 for 64 x 64), so such a layer stays as it is."""
    prefix = {id(layer): name for name, layer in model.named_modules()}
    found = []
    for layer in adapter(model).layers:
        for name, module in layer.named_modules():
            if (type(module) is torch.nn.Linear and module.in_features % BLOCKSIZE == 0
                    and not any(part.startswith("lora_") for part in name.split("."))
                    and not any(p.requires_grad for p in module.parameters())):
                found.append((f"{prefix[id(layer)]}.{name}", module))
    return found


def frozen_linear_parameters(model) -> List[torch.nn.Parameter]:
    """The parameters of `frozen_linears(model)`: what `hold_nf4` will hold (kept out of a task's
    bfloat16 cast before it: no bfloat16 copy on the device where the load did not hold them)."""
    return [p for _, module in frozen_linears(model) for p in module.parameters()]


def hold_nf4(model, compute_dtype: torch.dtype) -> int:
    """Replace the frozen linear layers of `model` (`frozen_linears`) by NF4 `Linear4bit`s on their
    device, the exact layers kept on the host for `release_nf4`; returns how many are held. On any
    error, or Ctrl-C, every layer replaced so far is put back first."""
    bnb = bitsandbytes()
    originals: Dict[str, torch.nn.Linear] = model.__dict__.setdefault(_HELD, {})
    try:
        for name, linear in frozen_linears(model):
            device = linear.weight.device
            quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          compute_dtype=compute_dtype, compress_statistics=True,
                                          quant_type=QUANT_TYPE, device="meta")
            weight = held.exact_value(model, linear.weight).detach().clone()  # not its bfloat16 copy, if held
            quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False,
                                                 blocksize=BLOCKSIZE, compress_statistics=True, quant_type=QUANT_TYPE,
                                                 module=quantized).to(device)  # quantised on the way
            if linear.bias is not None:
                bias = held.exact_value(model, linear.bias).detach().clone().to(device)
                quantized.bias = torch.nn.Parameter(bias, requires_grad=False)
            quantized.support_avx512bf16_for_cpu = False  # one layout: not repacked in place for CPU inference
            quantized.train(linear.training)
            originals[name] = linear  # before the swap: release_nf4 puts back whatever was swapped
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)
            linear.to("cpu")
    except BaseException:
        release_nf4(model)
        raise
    return len(originals)


def release_nf4(model, device=None) -> int:
    """Put back every layer `hold_nf4` replaced, as it was, on `device` (default: the device its
    4-bit copy was on); returns how many."""
    originals = model.__dict__.pop(_HELD, {})
    for name, linear in originals.items():
        parent, _, child = name.rpartition(".")
        quantized = model.get_submodule(name)
        setattr(model.get_submodule(parent), child, linear.to(device or quantized.weight.device))
    return len(originals)


def nf4_bytes(numel: int) -> float:
    """Bytes of `numel` weights held by `hold_nf4`: half a byte each, a uint8 scale per block of 64
    and a float32 scale per 256 of those (double quantisation); the two code tables aside."""
    return numel / 2 + numel / BLOCKSIZE + 4 * numel / (BLOCKSIZE * 256)


def held_bytes(model) -> int:
    """Bytes of the quantisation constants of the layers held in 4 bits (the 4-bit weights themselves
    are parameters: counted with them), for the memory check."""
    total = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in _state_tensors(state))
    return total


def exact_bytes(model) -> int:
    """Bytes of the exact layers `hold_nf4` keeps on the host."""
    return sum(p.numel() * p.element_size() for linear in model.__dict__.get(_HELD, {}).values()
               for p in linear.parameters())


def _state_tensors(state) -> List[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return [t for t in tensors if isinstance(t, torch.Tensor)]
