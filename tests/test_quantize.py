"""adept_ext.models.quantize on its own, on the CPU and on a GPU (`tools/gpu_check.sh` runs the [cuda] cases
with the carried bitsandbytes wheel): `hold_nf4` swaps the frozen linear layers of the decoder for
bitsandbytes' NF4 `Linear4bit`s on the model's device, whose forward computes with the dequantised
weights and whose backward reaches the layers that train; `release_nf4` puts the very layers back,
bit for bit. A tiny random Llama, no tokenizer or data files (the runs: tests/test_nf4.py)."""
import copy

import pytest
import torch
from tiny_models import tiny_model

from adept_ext.models import quantize

bnb = pytest.importorskip("bitsandbytes")

# The forward's compute dtype per device: float32 on the CPU; bfloat16 on a GPU (under autocast, as a run).
COMPUTE_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
# Fixed before the first run, as fractions of the reference's largest |logit| (logits) and of the norm of
# its trainable gradients (gradients): the held model against a float32 model whose held linear weights
# are the dequantised NF4 ones. Float32: the same products, at most a summation order apart. Bfloat16:
# the held layers return float32 (of bfloat16 values) where nn.Linear returns bfloat16, so an op after
# them may round once instead of twice; bfloat16 keeps 8 bits (0.4 % relative), and the CPU's
# bfloat16 autocast measured 0.55 % (logits) and 0.75 % (gradients). The exact model's logits differ
# from the reference by 16 % of its largest (NF4's rounding of these random weights, measured on the CPU):
# at least NF4_GAP, so that agreeing with the reference means computing with the 4-bit weights.
TOLERANCE = {"cpu": (1e-5, 1e-5), "cuda": (3e-2, 5e-2)}
NF4_GAP = 0.05
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a GPU (tools/gpu_check.sh runs it)"))]


def _logits_and_grads(model, ids, device):
    """The logits and the trainable parameters' gradients of one forward and backward (bfloat16 autocast
    on a GPU, as a run's steps)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", DEVICES)
def test_hold_computes_with_the_dequantized_weights_and_release_restores_them(device):
    model = tiny_model("llama", layers=2, hidden=64).to(device)  # hidden 64: every row whole NF4 blocks
    for name, p in model.named_parameters():
        p.requires_grad_("layers.0." in name)  # layer 0 trains: the backward crosses layer 1's held layers
    exact = copy.deepcopy(model)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = dict(quantize.frozen_linears(model))
    assert len(frozen) == 7 and all(".layers.1." in n for n in frozen)  # q k v o gate up down of layer 1
    ids = torch.randint(2, 97, (3, 12), generator=torch.Generator().manual_seed(3)).to(device)

    assert quantize.hold_nf4(model, COMPUTE_DTYPE[device]) == len(frozen)
    reference = copy.deepcopy(exact)  # float32, its held layers' weights the dequantised NF4 ones
    for name, original in frozen.items():
        held = model.get_submodule(name)
        assert type(held) is bnb.nn.Linear4bit and held.compute_dtype == COMPUTE_DTYPE[device]
        assert held.weight.dtype == torch.uint8 and held.weight.device.type == device
        assert held.weight.numel() * 2 == original.in_features * original.out_features  # two weights a byte
        state = held.weight.quant_state
        assert state.quant_type == "nf4" and state.nested and state.absmax.device.type == device
        assert original.weight.device.type == "cpu"  # the exact layer waits on the host
        dequantized = bnb.functional.dequantize_4bit(held.weight.data, state)
        assert dequantized.dtype == torch.float32 and dequantized.shape == original.weight.shape
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(dequantized)
    assert all(type(m) is torch.nn.Linear for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))

    logits, grads = _logits_and_grads(model, ids, device)
    ref_logits, ref_grads = _logits_and_grads(reference, ids, device)
    exact_logits, _ = _logits_and_grads(exact, ids, device)
    logits_tol, grads_tol = TOLERANCE[device]
    scale = ref_logits.abs().max().item()
    assert (logits - ref_logits).abs().max().item() <= logits_tol * scale
    assert (exact_logits - ref_logits).abs().max().item() >= NF4_GAP * scale  # the tolerance tells them apart
    assert grads.keys() == ref_grads.keys() and len(grads) == 9  # layer 0's seven projections and two norms
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    flat, ref_flat = (torch.cat([g.flatten() for g in gs.values()]) for gs in (grads, ref_grads))
    assert (flat - ref_flat).norm().item() <= grads_tol * ref_flat.norm().item() and flat.abs().max() > 0
    assert all(model.get_submodule(n).weight.grad is None for n in frozen)

    assert quantize.release_nf4(model) == len(frozen) and quantize.release_nf4(model) == 0
    for name, original in frozen.items():
        assert model.get_submodule(name) is original and original.weight.device.type == device
    after = model.state_dict()
    assert after.keys() == source.keys()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in source.items())  # bit for bit
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert torch.equal(_logits_and_grads(model, ids, device)[0], exact_logits)
