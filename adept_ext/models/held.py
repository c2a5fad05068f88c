"""Weights held in a lower precision, their exact values kept (docs/design.md, "Precision").

A parameter is *held* when its data is replaced by a copy in a narrower dtype (bfloat16) for the
forward and backward passes: the Parameter object stays, and where the cast rounds (a float32
checkpoint's weights in bfloat16) its exact value waits on the host; a weight the cast keeps
exactly (a checkpoint published in bfloat16) keeps nothing. The record lives in the model's
`__dict__` (not a submodule): [(parameter, the dtype it is exact in, exact host tensor or None)].
`run` holds the weights from the load on (`models.load_model(hold=...)`), a task holds what does
not train (`training.device.hold_frozen`), and what is exact again comes from here: back on the
device (`release`), into a copy (`exact_value`) or, for merging and saving, on the host
(`export_exact`): the device never holds a held weight in float32 on that path.
"""
from contextlib import nullcontext
from typing import Iterable

import torch

_EXACT = "_adept_exact_frozen"


def records(model) -> list:
    """The model's held parameters: [(parameter, exact dtype, exact host tensor or None)]."""
    return model.__dict__.setdefault(_EXACT, [])


def hold(model, params: Iterable[torch.nn.Parameter], dtype: torch.dtype, device=None, exact_dtype=None) -> int:
    """Hold each floating-point parameter of `params` in `dtype` on `device` (default: where it is),
    exact in `exact_dtype` (default: its dtype now), its exact value kept on the host where the cast
    rounds; a parameter already in `dtype` on `device` and exact in it is left alone. Returns how
    many parameters the model holds."""
    held = records(model)
    already = {id(q) for q, _, _ in held}  # held once: its record keeps the exact value
    for p in params:
        if not p.is_floating_point() or id(p) in already:
            continue
        target, exact_as = torch.device(device) if device is not None else p.device, exact_dtype or p.dtype
        if p.dtype == dtype == exact_as and p.device == target:
            continue
        data = p.data.to(dtype)
        lossless = p.is_meta or torch.equal(data.to(p.dtype), p.data)  # a meta tensor has no value to keep
        held.append((p, exact_as, None if lossless else p.data.to("cpu")))  # on the CPU: no copy
        p.data = data.to(target)
    return len(held)


def exact_value(model, p: torch.nn.Parameter) -> torch.Tensor:
    """`p`'s exact value: its kept host copy, its held data in its exact dtype, or `p` itself where
    it is not held (a new tensor where it is)."""
    for q, dtype, exact in records(model):
        if q is p:
            return (exact if exact is not None else p.data).to(dtype)
    return p.data


def assign(model, p: torch.nn.Parameter, value: torch.Tensor):
    """Make `value` `p`'s exact value: where `p` is held, its record keeps it (on the host where
    the held dtype rounds it) and `p` holds it rounded; else `p` takes it (in `p`'s dtype)."""
    held = records(model)
    for i, (q, dtype, _) in enumerate(held):
        if q is p:
            value = value.to(dtype)
            data = value.to(p.dtype)
            held[i] = (q, dtype, None if torch.equal(data.to(dtype), value) else value.to("cpu"))
            p.data.copy_(data)
            return
    p.data.copy_(value.to(p.dtype))


def release(model, since: int = 0, trainable_only: bool = False) -> int:
    """Put back exact, on its device, every parameter held after the first `since` records (only
    those that now train where `trainable_only`); returns how many."""
    held = records(model)
    released = [r for r in held[since:] if r[0].requires_grad or not trainable_only]
    for p, dtype, exact in released:
        p.data = (p.data if exact is None else exact).to(p.device, dtype)
    gone = {id(r) for r in released}
    model.__dict__[_EXACT] = [r for r in held if id(r) not in gone]
    return len(released)


def export_exact(model, device="cpu") -> int:
    """The whole model on `device` (the host), every held parameter exact there from its kept copy
    (never through the device in its exact dtype); returns how many were held."""
    held = model.__dict__.pop(_EXACT, [])
    for p, dtype, exact in held:
        p.data = (exact if exact is not None else p.data).to(device).to(dtype)
    model.to(device)
    return len(held)


def exact_state_dict(model) -> dict:
    """`model.state_dict()` with each held parameter's exact value, on the host (for
    `save_pretrained(state_dict=...)`: the device never holds it in its exact dtype)."""
    exact = {id(p): (e if e is not None else p.data.to("cpu")).to(dtype) for p, dtype, e in records(model)}
    named = {name: exact[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in exact}
    return {key: named.get(key, value) for key, value in model.state_dict().items()}


def held_bytes(model) -> int:
    """Bytes of the exact values kept on the host."""
    return sum(exact.numel() * exact.element_size() for _, _, exact in records(model) if exact is not None)


def autocast_for(model, device):
    """bf16 autocast on `device` while `model` holds bfloat16 weights (a float32 activation cannot
    meet a bfloat16 weight outside it), else nothing."""
    if any(p.dtype == torch.bfloat16 for p in model.parameters()):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()
