"""Online EWC (methods/ewc.py): the Fisher against per-row gradients of Hugging Face's own loss, the
penalty against the merged weights' change, the online accumulation."""
import copy

import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext import data
from adept_ext.methods import Context, EwcConfig, get_method


def rows():
    batch = padded_batches(n_batches=1, batch=3)[0]
    batch["labels"][0] = -100  # a row without a labelled token: left out of the Fisher
    return data.BlockSet(data.TensorBlocks(batch))


def prepared(base):
    model = tiny_model("llama")
    method = get_method(EwcConfig(base=base, samples=8, rank=2, strength=3.0, decay=0.5))
    method.prepare(model, Context(general_probe=[]))
    model = method.base.peft_model if base == "lora" else model
    with torch.no_grad():  # as trained: the adapters' B away from 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return method, model


def direct_fisher(model, weights, blocks):
    """(1/N) Σ_n (∂ℓ_n/∂w)², ℓ_n the model's own `loss` of row n (Hugging Face's), over the rows with a label."""
    for w in weights:
        w.requires_grad_(True)
    total, n = [torch.zeros_like(w) for w in weights], 0
    for i in range(len(blocks)):
        row = blocks.rows([i])
        if (row["labels"][:, 1:] == -100).all():
            continue
        grads = torch.autograd.grad(model(**row).loss, weights)
        total = [t + g.pow(2) for t, g in zip(total, grads)]
        n += 1
    return [t / n for t in total], n


@pytest.mark.parametrize("base", ["lora", "full"])
def test_the_fisher_is_the_mean_squared_per_row_gradient(base):
    method, model = prepared(base)
    covered = method.covered(model)
    fisher, counted = method.task_fisher(model, rows())
    expected, n = direct_fisher(model, list(covered.values()), rows())
    assert counted == n == 2 and list(fisher) == list(covered)
    for name, want in zip(covered, expected):
        torch.testing.assert_close(fisher[name], want, rtol=1e-4, atol=1e-10)
    if base == "lora":
        assert all(name.endswith("proj.weight") and "base_layer" not in name for name in fisher)


def test_the_lora_penalty_is_the_fisher_weighted_change_of_the_merged_weights():
    method, model = prepared("lora")
    method.fisher = {name: torch.rand(w.shape) for name, w in method.covered(model).items()}
    got = method.penalties(model)[0]
    before = {name: w.detach().clone() for name, w in method.covered(model).items()}
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    want = sum((method.fisher[name] * (merged[name] - before[name]).pow(2)).sum() for name in before)
    torch.testing.assert_close(got, 0.5 * 3.0 * want, rtol=1e-5, atol=0)


def test_online_ewc_decays_the_earlier_fisher_and_the_full_penalty_anchors_at_the_last_task():
    method, model = prepared("full")
    method.rows = rows()
    first, _ = method.task_fisher(model, method.rows)
    model = method.end_task(model, None, {})
    method.base.prepare(model, Context(general_probe=[]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    second, _ = method.task_fisher(model, method.rows)
    method.end_task(model, None, {})
    for name in first:  # F = F_2 + γ F_1, γ = 0.5
        torch.testing.assert_close(method.fisher[name], second[name] + 0.5 * first[name])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02)
    want = sum((method.fisher[name] * 0.02 ** 2).sum() for name in method.fisher)
    torch.testing.assert_close(method.penalties(model)[0], 0.5 * 3.0 * want, rtol=1e-3, atol=0)
