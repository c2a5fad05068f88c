"""O-LoRA's orthogonality penalty in both norms (the paper's squared Frobenius, the public code's
entrywise L1): its gradient against the analytic one, and what it does to a planted conflict."""
import pytest
import torch
from tiny_models import padded_batches, tiny_model

import adept_ext
from adept_ext.methods import OLoraConfig
from adept_ext.methods.lora import lora_adapters, subspace_overlap


def second_task(penalty, lam=0.5):
    """An o_lora method after one finished task, prepared for the second on a tiny Llama: (model, method, task)."""
    model = tiny_model("llama")
    method = adept_ext.get_method(OLoraConfig(rank=2, lam=lam, penalty=penalty))
    probe = padded_batches()
    model = adept_ext.prepare(model, method, general_probe=probe, lr=1e-3, total_steps=1, progress=False).finish()
    for p in model.parameters():
        p.requires_grad_(False)
    task = adept_ext.prepare(model, method, general_probe=probe, lr=1e-3, total_steps=1, task_index=1, progress=False)
    return model, method, task


@pytest.mark.parametrize("penalty", ["fro2", "l1"])
def test_the_penalty_gradient_removes_a_planted_conflict(penalty):
    """Task 2's A planted inside task 1's subspace (A_2 = A_1 + a little noise): the penalty's
    gradient is the analytic one (fro2: 2λ A_2 A_1ᵀ A_1; l1: λ sign(A_2 A_1ᵀ) A_1) and gradient
    steps on the penalty alone shrink ‖A_1 A_2ᵀ‖_F; an A_2 orthogonal to A_1 costs nothing."""
    model, method, _ = second_task(penalty)
    adapters = lora_adapters(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, layer in adapters:
            old = method.previous[name]
            layer.lora_A["default"].weight.copy_(old + 0.01 * torch.randn(old.shape, generator=gen))
    (term,) = method.penalties(model)
    planted = float(term)
    term.backward()
    for name, layer in adapters:
        a, old = layer.lora_A["default"].weight, method.previous[name]
        overlap = a.detach() @ old.T
        want = 2 * 0.5 * overlap @ old if penalty == "fro2" else 0.5 * overlap.sign() @ old
        torch.testing.assert_close(a.grad, want, rtol=1e-5, atol=1e-7)
    before = subspace_overlap(method.previous, model)
    optimizer = torch.optim.SGD([layer.lora_A["default"].weight for _, layer in adapters], lr=0.5)
    for _ in range(40):
        optimizer.zero_grad()
        method.penalties(model)[0].backward()
        optimizer.step()
    assert subspace_overlap(method.previous, model) < 0.5 * before
    with torch.no_grad():  # rows orthogonal to every earlier A row: no penalty
        for name, layer in adapters:
            old = method.previous[name]
            basis = torch.linalg.qr(torch.cat([old.T, torch.randn(old.shape[1], 2, generator=gen)], 1)).Q
            layer.lora_A["default"].weight.copy_(basis[:, old.shape[0]:old.shape[0] + 2].T)
    assert float(method.penalties(model)[0]) < 1e-5 * planted


def test_the_overlap_is_reported_and_survives_a_resume():
    """end_task reports `lora_subspace_overlap` from the second task on, for seq_lora too (which
    adds no penalty), and the earlier A's travel in the method's state."""
    model, method, _ = second_task("fro2")
    report = {}
    method.end_task(model, None, report)
    assert report["lora_subspace_overlap"] > 0
    assert {n: a.shape[0] for n, a in method.previous.items()} == {n: 4 for n in method.previous}
    fresh = adept_ext.get_method(OLoraConfig(rank=2))
    fresh.load_state_dict(method.state_dict())
    assert all(torch.equal(fresh.previous[n].cpu(), a.cpu()) for n, a in method.previous.items())
