"""EoupCT (adept_ext.methods.eoupct): the proxy, the virtual step, the projection, the conflict
correction, what each ablation and option changes, the option checks, and a run on the continual
runner (the every-method and the kill-and-resume tests in test_continual.py cover eoupct's
defaults)."""
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from method_spy import TaskSpy
from test_continual import options, quiet, workspace  # noqa: F401  (the module-scoped workspace fixture)
from tiny_models import padded_batches, tiny_model
from transformers import AutoConfig

from adept_ext.continual import ContinualConfig, run
from adept_ext.methods import Context, EoupCTConfig, MethodError, create, get_method
from adept_ext.methods import eoupct as eoupct_module
from adept_ext.methods.eoupct import EoupCT, student_targets
from adept_ext.methods.lora import lora_adapters, target_modules

STEPS = 4  # the task's optimizer steps (ctx.total_steps)


def context(task_index=0):
    return Context(general_probe=[], task_index=task_index, lr=1e-2, weight_decay=0.01, total_steps=STEPS)


def optimizer_for(method, setup):
    """AdamW over the method's groups (lr and weight decay: the context's) with its step hooks."""
    optimizer = torch.optim.AdamW(setup.groups)
    method.attach(optimizer)
    return optimizer


def make(student="lora", **kw):
    model = tiny_model("llama", layers=2)
    method = get_method(EoupCTConfig(student=student, **kw))
    setup = method.prepare(model, context())
    return model, method, optimizer_for(method, setup)


def next_task(model, method):
    """End the task; the model and a new optimizer for the next one."""
    model = method.end_task(model, None, {})
    setup = method.prepare(model, context(task_index=1))
    return model, optimizer_for(method, setup)


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


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


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
    model, optimizer = next_task(model, method)
    assert method.memory.k > 0
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
    method.prepare(model, context(task_index=1))
    assert any(not torch.equal(kept[n], t) for n, t in method.adapter.items())  # the end-of-task adapter
    with torch.no_grad():
        torch.testing.assert_close(model(**batches[0]).logits, merged, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- what each ablation / option changes
def prompt_search(no_virtual=False, g_scale=1.0, shift=0.0):
    """The prompt's ascent direction (−.grad after one search) with g_new = g_scale·(a fixed random
    direction), the student first moved by −shift·g_new; alpha 0.5, proxy embeds (no sampling)."""
    _, method, _ = make(proxy="embeds", alpha=0.5, no_virtual=no_virtual)
    perturb_student(method)
    torch.manual_seed(5)
    g_new = [g_scale * torch.randn_like(p) for p in method.trainable]
    with torch.no_grad():
        for p, g in zip(method.trainable, g_new):
            p.sub_(shift * g)
    method._optimise_prompt(g_new)
    return method.prompt.grad.clone()


def test_no_virtual_searches_the_prompt_at_theta_instead_of_theta_virt():
    default = prompt_search()                           # at θ_virt = θ − α g_new
    assert torch.equal(default, prompt_search(no_virtual=True, shift=0.5))  # = at a student moved to θ − α g_new
    at_theta = prompt_search(no_virtual=True)
    assert torch.equal(at_theta, prompt_search(g_scale=0.0))  # no_virtual ignores g_new: the search at θ
    assert not torch.allclose(default, at_theta, rtol=1e-3, atol=0)


@pytest.mark.parametrize("correct", [True, False], ids=["default", "no_conflict"])
def test_conflict_correction_removes_a_planted_conflict_and_no_conflict_sums(correct):
    model, method, optimizer = make(proxy="embeds", no_conflict=not correct)
    perturb_student(method)
    method._optimise_prompt([torch.zeros_like(p) for p in method.trainable])
    g_pre = torch.autograd.grad(method.proxy_loss(*method.cache), method.trainable)
    torch.manual_seed(4)
    g_new = [-2 * g + 0.01 * g.norm() * torch.randn_like(g) for g in g_pre]  # ⟨g_new, g_pre⟩ < 0
    for p, g in zip(method.trainable, g_new):
        p.grad = g.clone()
    method.step = 1  # not a prompt-optimisation step: g_pre is the one computed above
    method._before_step(optimizer, (), {})  # the memory is empty: the projections change nothing
    dot = lambda a, b: sum((x * y).sum() for x, y in zip(a, b))  # noqa: E731
    combined = [p.grad for p in method.trainable]
    plain = [a + b for a, b in zip(g_new, g_pre)]
    corrected = [c - g for c, g in zip(combined, g_pre)]  # .grad = g̃_new* + g̃_pre
    if correct:
        assert abs(dot(corrected, g_pre)) <= 1e-4 * dot(g_pre, g_pre)
        assert not torch.allclose(flat(combined), flat(plain), rtol=1e-2, atol=0)
    else:  # the plain sum, the conflict left in
        torch.testing.assert_close(flat(combined), flat(plain), rtol=1e-6, atol=1e-9)
        assert dot(corrected, g_pre) < -dot(g_pre, g_pre)


def test_grad_projection_projects_the_gradient_but_does_not_hold_with_adamw():
    """where="grad": the projected gradients are in the null space, AdamW's updates are not (the
    measured reason for the default where="update", whose updates are: see the orthogonality test)."""
    model, method, optimizer = make(where="grad", proxy="none")
    batches = padded_batches(n_batches=4)
    for batch in batches:
        train_step(model, method, optimizer, batch)
    model, optimizer = next_task(model, method)
    assert method._projector is None and method.memory.k > 0
    errors = []
    for batch in batches:
        old = [p.detach().clone() for p in method.trainable]
        train_step(model, method, optimizer, batch)
        assert method.memory.orthogonality_error([p.grad for p in method.trainable]) <= 1e-5
        errors.append(method.memory.orthogonality_error([p.detach() - o for p, o in zip(method.trainable, old)]))
    assert max(errors) > 1e-3


@pytest.mark.parametrize("target", ["hidden", "logits"])
def test_target_compares_the_last_hidden_states_or_the_logits(target):
    model, method, _ = make("full", proxy="embeds", target=target)
    perturb_student(method)
    seq, features = method.pseudo_sequence(method.prompt)
    with torch.no_grad():
        teacher, student = (m(inputs_embeds=seq, output_hidden_states=True) for m in (method.teacher, model))
    pick = (lambda out: out.hidden_states[-1]) if target == "hidden" else (lambda out: out.logits)  # noqa: E731
    width = model.config.hidden_size if target == "hidden" else model.config.vocab_size
    assert features.shape == (1, seq.shape[1], width)
    torch.testing.assert_close(features, pick(teacher), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(method.proxy_loss(seq, features), F.mse_loss(pick(student), pick(teacher)),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("proxy", ["embeds", "none"])
def test_proxy_none_leaves_the_task_gradient_alone(proxy):
    """With an empty memory the step's .grad is g_new itself without a proxy, g̃_new* + g_pre with one."""
    model, method, optimizer = make(proxy=proxy)
    perturb_student(method)
    method.loss(model, padded_batches()[0]).backward()
    g_new = flat(p.grad for p in method.trainable)
    method._before_step(optimizer, (), {})
    if proxy == "none":
        assert method.prompt is None and method.last_pre is None
        assert torch.equal(flat(p.grad for p in method.trainable), g_new)
    else:
        assert not torch.allclose(flat(p.grad for p in method.trainable), g_new, rtol=1e-3, atol=0)


def test_memory_delta_adds_the_task_change():
    model, method, optimizer = make(proxy="none")
    start = [p.detach().clone() for p in method.trainable]
    for batch in padded_batches(n_batches=STEPS):
        train_step(model, method, optimizer, batch)
    (direction,) = method.task_directions()
    assert all(torch.equal(d, p.detach() - s) for d, p, s in zip(direction, method.trainable, start))
    assert method.windows == []  # no gradient sums kept


def test_memory_gpm_adds_the_top_principal_direction_of_the_windowed_gradient_sums():
    """directions = 1: 2 windows of STEPS/2 steps (ctx.total_steps); the added direction is the
    top principal direction of the two sums, scaled by its singular value (up to sign)."""
    model, method, optimizer = make(proxy="none", memory="gpm", directions=1)
    start = flat(method.trainable)
    grads = []
    for batch in padded_batches(n_batches=STEPS):
        optimizer.zero_grad(set_to_none=True)
        method.loss(model, batch).backward()
        grads.append(flat(p.grad for p in method.trainable))  # the raw g_new the hook sums
        optimizer.step()
    sums = torch.stack([grads[0] + grads[1], grads[2] + grads[3]])
    torch.testing.assert_close(torch.stack([flat(w) for w in method.windows]), sums, rtol=1e-6, atol=1e-9)
    (direction,) = method.task_directions()
    direction = flat(direction)
    _, s, vh = torch.linalg.svd(sums.double(), full_matrices=False)
    expected = (s[0] * vh[0]).float() * torch.sign(direction @ vh[0].float())
    torch.testing.assert_close(direction, expected, rtol=1e-4, atol=1e-4 * float(s[0]) / direction.numel() ** 0.5)
    assert not torch.allclose(direction, flat(method.trainable) - start)  # not the task's change (delta)


@pytest.mark.parametrize("change,message", [
    (dict(lam=-0.1), "eoupct_lambda must be >= 0, got -0.1"),
    (dict(proxy_len=0), "eoupct_proxy_len must be in 4..32, got 0"),
    (dict(proxy_len=3), "eoupct_proxy_len must be in 4..32"),
    (dict(proxy_len=33), "eoupct_proxy_len must be in 4..32"),
    (dict(tau=0.0), "eoupct_tau must be > 0, got 0.0"),
    (dict(proxy_lr=float("nan")), "eoupct_proxy_lr must be > 0, got nan"),
    (dict(alpha=-1.0), "eoupct_alpha must be >= 0"),
    (dict(proxy="magic"), "eoupct_proxy must be one of gumbel, embeds, none, got 'magic'"),
    (dict(student="adapter"), "eoupct_student must be one of"),
    (dict(where="both"), "eoupct_where must be one of"),
    (dict(target="attn"), "eoupct_target must be one of hidden, logits"),
    (dict(memory="all"), "eoupct_memory must be one of gpm, delta"),
    (dict(rank=0), "eoupct_rank must be >= 1, got 0"),
    (dict(gen_steps=0), "eoupct_gen_steps must be >= 1"),
    (dict(proxy_every=0), "eoupct_proxy_every must be >= 1"),
    (dict(proxy_steps=0), "eoupct_proxy_steps must be >= 1"),
    (dict(directions=0), "eoupct_directions must be >= 1"),
])
def test_bad_hyperparameters_are_method_errors_when_the_config_is_built(change, message):
    with pytest.raises(MethodError, match=re.escape(message)):
        EoupCTConfig(**change)
    flat_options = {("eoupct_lambda" if k == "lam" else f"eoupct_{k}"): v for k, v in change.items()}
    with pytest.raises(MethodError, match=re.escape(message)):  # the same from a runner's flat options
        create("eoupct", dataclasses.replace(ContinualConfig(method="eoupct"), **flat_options), sequence=True)


def test_every_non_default_option_runs_end_to_end_on_user_task_files(workspace, monkeypatch):  # noqa: F811
    """One run with every option off its default, each seen where it acts (a method that ignored
    one, running its default instead, fails): student full (every parameter trains, a frozen
    teacher copy), proxy embeds (S is the prompt itself: L positions, no generated ones), no_virtual
    (the prompt search runs at θ itself), no_conflict (no conflict correction), where grad (no
    update projector), target logits (vocabulary-wide features), memory gpm with 2 directions
    (2·2 gradient windows, 2 directions added after the first task)."""
    spy = TaskSpy(monkeypatch)
    seen = {"conflict_corrections": 0, "virtual_offsets": []}
    real_correct, real_proxy_loss = eoupct_module.conflict_correct_, EoupCT.proxy_loss

    def counting_correct(*args, **kwargs):
        seen["conflict_corrections"] += 1
        return real_correct(*args, **kwargs)

    def proxy_loss(self, seq, target, params=None):
        if isinstance(params, dict):  # the prompt search's θ_virt: its largest distance from θ
            seen["virtual_offsets"].append(max(float((params[n].detach() - p.detach()).abs().max())
                                               for n, p in zip(self.names, self.trainable)))
        return real_proxy_loss(self, seq, target, params)

    def note(record):
        m = record.method
        record.notes.update(teacher=m.teacher is not None, projector=m._projector is not None, windows=len(m.windows),
                            sequence=tuple(m.cache[0].shape), features=tuple(m.cache[1].shape))

    monkeypatch.setattr(eoupct_module, "conflict_correct_", counting_correct)
    monkeypatch.setattr(EoupCT, "proxy_loss", proxy_loss)
    spy.at_finish = note
    change = dict(eoupct_student="full", eoupct_proxy="embeds", eoupct_no_virtual=True, eoupct_no_conflict=True,
                  eoupct_where="grad", eoupct_target="logits", eoupct_memory="gpm", eoupct_directions=2)
    report = run(options(workspace, "eo-options", method="eoupct", **change), progress=False, log=quiet)
    assert len(report["matrix"]) == 3 and report["metrics"]["BWT"] is not None
    assert report["per_task"][0]["summary"].startswith("trains every parameter with EoupCT")
    config = AutoConfig.from_pretrained(workspace / "tiny")
    for record in spy.tasks:
        assert not record.frozen and not any("lora" in n for n in record.names)  # student full
        assert not record.unchanged()
        assert record.notes["teacher"]                                            # its teacher: a frozen copy
        assert record.notes["sequence"] == (1, 16, config.hidden_size)            # proxy embeds (L = 16, M = 0)
        assert record.notes["features"] == (1, 16, config.vocab_size)             # target logits
        assert not record.notes["projector"]                                      # where grad
        assert record.notes["windows"] == 4                                       # memory gpm, directions 2
    assert [p["eoupct"]["added"] for p in report["per_task"]] == [2, 2]           # memory gpm, directions 2
    assert seen["virtual_offsets"] and max(seen["virtual_offsets"]) == 0          # no_virtual
    assert seen["conflict_corrections"] == 0                                      # no_conflict


@pytest.mark.parametrize("teacher", ["auto", "base", "task_start"])
def test_the_teacher_is_the_model_before_the_first_task_or_at_the_task_start(teacher):
    """In the second task the LoRA student's teacher computes what the original model computed
    (auto, base: θ⁰, as the paper and the public code) or what the model computed after the first
    task (task_start)."""
    model, method, optimizer = make(proxy="embeds", teacher=teacher)
    embeds = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        original = model(inputs_embeds=embeds).logits
    for batch in padded_batches(n_batches=3):
        train_step(model, method, optimizer, batch)
    with torch.no_grad():
        after_first = model(inputs_embeds=embeds).logits
    assert (after_first - original).abs().max() > 1e-3
    model, _ = next_task(model, method)
    with torch.no_grad():
        got = method._call(embeds, "teacher").logits
    want = after_first if teacher == "task_start" else original
    torch.testing.assert_close(got, want[:, -1:], rtol=1e-5, atol=1e-5)  # the proxy keeps the last logits


def adapted(model):
    return {name.rsplit(".", 1)[-1] for name, _ in lora_adapters(model)}


def test_the_students_scaling_and_projections():
    """eoupct_lora_alpha sets PEFT's scaling alpha / rank (0: 2 x rank) and eoupct_target_modules
    the adapted projections: by default the public code's student (alpha 32 at rank 4, the MLP gate
    projections); all: every projection; names; an absent projection is refused."""
    model, method, _ = make()
    assert adapted(model) == {"gate_proj"}
    assert all(layer.scaling["default"] == 32.0 / 4 for _, layer in lora_adapters(model))
    model, method, _ = make(lora_alpha=0.0, target_modules="all")
    assert adapted(model) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(layer.scaling["default"] == 2.0 for _, layer in lora_adapters(model))
    model, method, _ = make(target_modules="up_proj,down_proj")
    assert adapted(model) == {"up_proj", "down_proj"}
    with pytest.raises(MethodError, match="the model has no qkv_proj projections"):
        make(target_modules="qkv_proj,gate_proj")
    with pytest.raises(MethodError, match="eoupct_teacher base needs the lora student"):
        EoupCTConfig(student="full", teacher="base")


@pytest.mark.parametrize("arch, gate", [("llama", ["gate_proj"]), ("phi3", ["gate_up_proj"]),
                                        ("mixtral", None), ("olmoe", None)])
def test_the_default_student_takes_the_mlp_gate_projections(arch, gate):
    """eoupct_target_modules gate: the family's MLP gate projection (Phi-3's fused gate_up_proj);
    where the experts are fused tensors (no gate projection as a linear layer) every projection
    of the family, as `all`."""
    model = tiny_model(arch)
    assert student_targets(model, "gate") == (gate or target_modules(model))
    assert student_targets(model, "all") == target_modules(model)


def test_the_base_is_shifted_exactly_where_the_runner_holds_it_in_bfloat16():
    """W ← W − s·B₀A₀ goes into the exact value a held weight keeps (`held.assign`), which the merge
    and the save read, not only into its bfloat16 copy (which would leave B₀A₀ counted twice)."""
    from adept_ext.models import held

    model, method, optimizer = make()
    for batch in padded_batches(n_batches=2):
        train_step(model, method, optimizer, batch)
    model = method.end_task(model, None, {})
    held.hold(model, list(model.parameters()), torch.bfloat16)  # as the runners hold the merged model
    exact = {id(p): held.exact_value(model, p).clone() for p in model.parameters()}
    method.prepare(model, context(task_index=1))
    shifted = 0
    for name, layer in lora_adapters(model):
        w = layer.base_layer.weight
        b0a0 = method.adapter[f"{name}.lora_B.default.weight"] @ method.adapter[f"{name}.lora_A.default.weight"]
        assert torch.equal(held.exact_value(model, w), exact[id(w)] - b0a0 * layer.scaling["default"]), name
        assert w.dtype == torch.bfloat16 and torch.equal(w, held.exact_value(model, w).to(torch.bfloat16)), name
        shifted += 1
    assert shifted
