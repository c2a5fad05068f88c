"""EoupCT (adept_ext.methods.eoupct): the proxy, the virtual step, the projection, the conflict
correction, the option checks, and runs on the continual runner (the every-method and the
kill-and-resume tests in test_continual.py cover eoupct's defaults)."""
import dataclasses

import pytest
import torch

from adept_ext.continual import ContinualConfig, run
from adept_ext.methods import Context, MethodError, create
from adept_ext.train import optimizer_for
from test_continual import options, quiet, workspace  # noqa: F401  (the module-scoped workspace fixture)
from tiny_models import padded_batches, tiny_model


def make(student="lora", **kw):
    cfg = ContinualConfig(method="eoupct", steps=4, warmup_steps=0, lr=1e-2, weight_decay=0.01, eoupct_student=student,
                          **{f"eoupct_{k}": v for k, v in kw.items()})
    model = tiny_model("llama", layers=2)
    method = create("eoupct", cfg, sequence=True)
    setup = method.prepare(model, Context(general_probe=[]))
    optimizer, _ = optimizer_for(method, setup, cfg)
    return model, method, optimizer


def perturb_student(method, scale=0.05):
    """Move the student away from the teacher (at a task's start they compute the same function)."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in method.trainable:
            p.add_(scale * torch.randn_like(p))


def train_step(model, method, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    method.loss(model, batch).backward()
    optimizer.step()


@pytest.mark.parametrize("mode,length", [("embeds", 16), ("gumbel", 16 + 8)])
def test_proxy_has_the_right_shape_and_a_gradient_wrt_the_prompt(mode, length):
    model, method, _ = make(proxy=mode)
    seq, target = method.pseudo_sequence(method.prompt)
    assert seq.shape == target.shape == (1, length, model.config.hidden_size)
    with torch.no_grad():  # the teacher's features collected during generation = a forward on S
        full = method.model(inputs_embeds=seq, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(target, full, rtol=1e-4, atol=1e-5)
    virt = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in zip(method.names, method.trainable)}
    (grad,) = torch.autograd.grad(method.proxy_loss(seq, target, virt), [method.prompt])
    assert grad.shape == method.prompt.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("student", ["lora", "full"])
def test_the_virtual_step_and_prompt_search_leave_the_weights_and_grads_bit_identical(student):
    model, method, optimizer = make(student)
    batch = padded_batches()[0]
    train_step(model, method, optimizer, batch)  # a second task-like state: memory-free but moved
    method.proxy_grads = [[torch.randn_like(p) for p in method.trainable]]  # exercise the cos² penalty too
    before = {n: p.detach().clone() for n, p in model.state_dict(keep_vars=True).items()}
    method.loss(model, batch).backward()
    grads = [p.grad.clone() for p in method.trainable]
    prompt = method.prompt.detach().clone()
    method._optimise_prompt([p.grad for p in method.trainable])
    assert not torch.equal(prompt, method.prompt)  # the prompt moved ...
    for n, p in model.state_dict(keep_vars=True).items():  # ... the model did not, not even by one bit
        assert torch.equal(p.detach(), before[n]), n
    assert all(torch.equal(p.grad, g) for p, g in zip(method.trainable, grads))


@pytest.mark.parametrize("student", ["lora", "full"])
def test_after_a_task_the_updates_are_orthogonal_to_the_stored_directions(student):
    model, method, optimizer = make(student)
    batches = padded_batches(n_batches=4)
    for batch in batches:
        train_step(model, method, optimizer, batch)
    model = method.end_task(model, None, {})
    setup = method.prepare(model, Context(general_probe=[], task_index=1))
    assert method.memory.k > 0
    optimizer, _ = optimizer_for(method, setup, method.cfg)
    for batch in batches:
        old = [p.detach().clone() for p in method.trainable]
        train_step(model, method, optimizer, batch)
        delta = [p.detach() - o for p, o in zip(method.trainable, old)]
        assert sum(d.norm() ** 2 for d in delta) > 0
        assert method.memory.orthogonality_error(delta) <= 1e-5


def test_the_kept_adapter_is_re_added_without_changing_the_function():
    model, method, optimizer = make()
    batches = padded_batches(n_batches=2)
    for batch in batches:
        train_step(model, method, optimizer, batch)
    kept = {n: t.clone() for n, t in method.adapter.items()}
    model = method.end_task(model, None, {})
    assert not any("lora" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        merged = model(**batches[0]).logits
    method.prepare(model, Context(general_probe=[], task_index=1))
    assert any(not torch.equal(kept[n], t) for n, t in method.adapter.items())  # the end-of-task adapter
    with torch.no_grad():
        torch.testing.assert_close(model(**batches[0]).logits, merged, rtol=1e-5, atol=1e-5)


def test_grad_projection_alone_does_not_hold_with_adamw():
    """The measured reason for where="update": AdamW rescales a projected gradient out of the null space."""
    model, method, optimizer = make(where="grad", proxy="none")
    batches = padded_batches(n_batches=4)
    for batch in batches:
        train_step(model, method, optimizer, batch)
    model = method.end_task(model, None, {})
    setup = method.prepare(model, Context(general_probe=[], task_index=1))
    optimizer, _ = optimizer_for(method, setup, method.cfg)
    errors = []
    for batch in batches:
        old = [p.detach().clone() for p in method.trainable]
        train_step(model, method, optimizer, batch)
        errors.append(method.memory.orthogonality_error([p.detach() - o for p, o in zip(method.trainable, old)]))
    assert max(errors) > 1e-3


@pytest.mark.parametrize("correct", [True, False])
def test_conflict_correction_removes_a_planted_conflict(correct):
    model, method, optimizer = make(proxy="embeds", no_conflict=not correct)
    perturb_student(method)
    method._optimise_prompt([torch.zeros_like(p) for p in method.trainable])
    g_pre = torch.autograd.grad(method.proxy_loss(*method.cache), method.trainable)
    torch.manual_seed(4)
    for p, g in zip(method.trainable, g_pre):  # g_new = −2 g_pre + noise: ⟨g_new, g_pre⟩ < 0
        p.grad = -2 * g + 0.01 * g.norm() * torch.randn_like(g)
    method.step = 1  # not a prompt-optimisation step: g_pre is the one computed above
    method._before_step(optimizer, (), {})
    dot = lambda a, b: sum((x * y).sum() for x, y in zip(a, b))  # noqa: E731
    corrected = [p.grad - g for p, g in zip(method.trainable, g_pre)]  # .grad = g̃_new* + g̃_pre
    if correct:
        assert abs(dot(corrected, g_pre)) <= 1e-4 * dot(g_pre, g_pre)
    else:
        assert dot(corrected, g_pre) < -dot(g_pre, g_pre)


@pytest.mark.parametrize("change,message", [
    (dict(eoupct_lambda=-0.1), "eoupct_lambda must be >= 0"),
    (dict(eoupct_proxy_len=0), "eoupct_proxy_len must be in 4..32"),
    (dict(eoupct_proxy_len=3), "eoupct_proxy_len must be in 4..32"),
    (dict(eoupct_proxy_len=33), "eoupct_proxy_len must be in 4..32"),
    (dict(eoupct_tau=0.0), "eoupct_tau must be > 0"),
    (dict(eoupct_alpha=-1.0), "eoupct_alpha must be >= 0"),
    (dict(eoupct_proxy="magic"), "eoupct_proxy must be one of gumbel, embeds, none"),
    (dict(eoupct_student="adapter"), "eoupct_student must be one of"),
    (dict(eoupct_where="both"), "eoupct_where must be one of"),
    (dict(eoupct_rank=0), "eoupct_rank must be >= 1"),
])
def test_bad_hyperparameters_are_method_errors_when_the_method_is_created(change, message):
    with pytest.raises(MethodError, match=message):
        create("eoupct", dataclasses.replace(ContinualConfig(method="eoupct"), **change), sequence=True)


@pytest.mark.parametrize("change", [dict(eoupct_student="full"), dict(eoupct_proxy="embeds"),
                                    dict(eoupct_proxy="none"), dict(eoupct_no_virtual=True, eoupct_no_conflict=True),
                                    dict(eoupct_where="grad", eoupct_target="logits", eoupct_memory="gpm")],
                         ids=["full", "embeds", "none", "no_virtual_no_conflict", "grad_logits_gpm"])
def test_options_run_end_to_end_on_user_task_files(workspace, change):  # noqa: F811
    name = "eo-" + "-".join(f"{v}" for v in change.values())
    report = run(options(workspace, name, method="eoupct", **change), progress=False, log=quiet)
    assert len(report["matrix"]) == 3 and report["metrics"]["BWT"] is not None
    assert [p["eoupct"]["memory_directions"] for p in report["per_task"]][0] >= 1
