"""A-GEM (methods/agem.py): the projected gradient against the formula, from a reference gradient
computed directly with Hugging Face's own loss on the step's buffer rows."""
import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext import data
from adept_ext.methods import AgemConfig, Context, get_method


def method_with_a_buffer(seed):
    model = tiny_model("llama")
    method = get_method(AgemConfig(rank=2, fraction=1.0, batch=2))
    blocks = [data.BlockSet(data.TensorBlocks(b)) for b in padded_batches(n_batches=2, batch=3)]
    method.blocks, method.kept = blocks, {0: [0, 1, 2]}
    method.prepare(model, Context(general_probe=[], task_index=1, seed=seed))
    with torch.no_grad():
        for name, p in method.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return method


@pytest.mark.parametrize("conflict", [True, False])
def test_the_projection_removes_the_conflict_with_the_reference_gradient(conflict):
    method = method_with_a_buffer(seed=3)
    model, params = method.peft_model, method.trainable
    rows = method.reference_batch()
    reference = torch.autograd.grad(model(**rows).loss, params)
    g_ref = torch.cat([r.flatten() for r in reference])
    task = torch.randn(g_ref.shape, generator=torch.Generator().manual_seed(0))
    task = task - (task @ g_ref) / (g_ref @ g_ref) * g_ref + (-0.5 if conflict else 0.5) * g_ref
    sizes = [p.numel() for p in params]
    for p, g in zip(params, task.split(sizes)):
        p.grad = g.reshape(p.shape).clone()
    stats = method.project()
    got = torch.cat([p.grad.flatten() for p in params])
    dot = task @ g_ref
    assert (dot < 0) == conflict and float(stats[0]) == pytest.approx(float(dot), rel=1e-4)
    want = task - dot / (g_ref @ g_ref) * g_ref if conflict else task
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert float(got @ g_ref) >= -1e-5 * float(got.norm() * g_ref.norm())
    assert int(method.projected) == int(conflict) and method.steps == 1


def test_each_step_draws_its_rows_from_the_seed_and_the_step():
    a, b = method_with_a_buffer(seed=3), method_with_a_buffer(seed=3)
    first = a.reference_batch()["input_ids"]
    assert torch.equal(first, b.reference_batch()["input_ids"]) and first.shape[0] == 2
    a.steps = b.steps = 5
    assert torch.equal(a.reference_batch()["input_ids"], b.reference_batch()["input_ids"])
