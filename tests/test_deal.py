"""DEAL (wavelet-kernel retention + controlled update of the previous LoRA, merged after each
task) and the per_task oracle: exact start of a task, merge equality, option checks, and runs on
the continual runner."""
import re

import pytest
import torch
from peft import PeftModel
from test_continual import options, quiet, workspace  # noqa: F401 (the module-scoped workspace fixture)
from tiny_models import padded_batches, tiny_model
from transformers import AutoModelForCausalLM

from adept_ext.continual import config_from, run
from adept_ext.methods import Context, DealConfig, MethodError, get_method
from adept_ext.methods.lora import lora_adapters


def logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits for b in batches])


def after_first_task(**options):
    """A DEAL method and the tiny model after a first task whose LoRA was set to random values."""
    method = get_method(DealConfig(rank=4, **options))
    model = tiny_model("llama", layers=2)
    method.prepare(model, Context(general_probe=[]))
    with torch.no_grad():
        for p in method.peft_model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return method, method.end_task(model, None, {})


SETTINGS = [dict(), dict(filter="haar"), dict(filter_on="a"), dict(filter_on="b"),
            dict(filter="haar", filter_on="b", scales=1), dict(new_rank=0), dict(new_rank=0, filter_on="a")]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_a_task_starts_from_the_previous_model_exactly(settings):
    method, model = after_first_task(**settings)
    batches = padded_batches()
    before = logits(model, batches)
    setup = method.prepare(model, Context(general_probe=[]))
    assert setup.trainable and all(p.requires_grad for p in setup.trainable)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "original" in n or "base_layer" in n)
    assert torch.equal(logits(method.peft_model, batches), before)


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_merged_model_equals_the_unmerged_deal_model(settings, tmp_path):
    method, model = after_first_task(**settings)
    setup = method.prepare(model, Context(general_probe=[]))
    with torch.no_grad():  # a trained state: every filter and update parameter away from its start
        for p in setup.trainable:
            p.add_(torch.randn_like(p) * 0.02)
    batches = padded_batches()
    unmerged = logits(method.peft_model, batches)
    assert not torch.allclose(unmerged, logits(tiny_model("llama", layers=2), batches), atol=1e-3)
    merged = method.end_task(model, None, {})
    assert not lora_adapters(merged)
    merged.save_pretrained(tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert not any("lora" in n or "parametrizations" in n for n in plain.state_dict())
    # float32 merged (W + s·B·A) against unmerged (W x + s·B(A x)): the sums are ordered differently;
    # up to 1.02e-5 measured on a CPU without AVX-512, against differences of 1e-3 and more above
    torch.testing.assert_close(logits(plain, batches), unmerged, atol=3e-5, rtol=0)
    # The kept factors are the adapted ones: the next task starts from this merged model exactly.
    method.prepare(plain, Context(general_probe=[]))
    assert torch.equal(logits(method.peft_model, batches), logits(merged, batches))


def test_the_new_task_learns_through_the_fresh_term_and_keeps_it():
    """From task 2 on the fresh term gets gradients, and its factors are the next task's Y."""
    method, model = after_first_task()
    method.prepare(model, Context(general_probe=[]))
    assert len(method.fresh) == 2 * len(method.factors)
    method.loss(method.peft_model, padded_batches(n_batches=1)[0]).backward()
    assert all(p.grad is not None for p in method.fresh)
    assert any(float(p.grad.abs().max()) > 0 for p in method.fresh[1::2])  # F_B: the output moves
    with torch.no_grad():
        for p in method.fresh:
            p.normal_(0, 0.05)
    fresh = {name: (layer.parametrizations.weight[0].fresh.detach().clone() for layer in
                    (lora.lora_A["default"], lora.lora_B["default"])) for name, lora in lora_adapters(model)}
    method.end_task(model, None, {})
    for name, (f_a, f_b) in fresh.items():
        assert torch.equal(method.factors[name][0], f_a) and torch.equal(method.factors[name][1], f_b.T)


def test_merge_is_exact_up_to_rounding_in_float64():
    method, model = after_first_task()
    setup = method.prepare(model.double(), Context(general_probe=[]))
    with torch.no_grad():
        for p in setup.trainable:
            p.add_(torch.randn_like(p) * 0.2)
    batches = padded_batches()
    unmerged = logits(method.peft_model, batches)
    torch.testing.assert_close(logits(method.end_task(model, None, {}), batches), unmerged, atol=1e-10, rtol=0)


def test_loss_adds_the_retention_and_update_penalties():
    method, model = after_first_task(lambda1=0.5, a=4.0, lambda2=0.25, b=2.0)
    method.prepare(model, Context(general_probe=[]))
    with torch.no_grad():
        for p in method.retain + method.updates:
            p.fill_(0.5)
    batch = padded_batches(n_batches=1)[0]
    task = method.peft_model(**batch).loss
    retain = sum(p.numel() for p in method.retain) * 0.5 ** 4
    update = sum(p.numel() for p in method.updates) * 0.5 ** 2
    assert float(method.loss(method.peft_model, batch)) == pytest.approx(float(task) + 0.5 * retain + 0.25 * update,
                                                                         rel=1e-5)


BAD = [
    (dict(lambda1=-0.1), "deal_lambda1 must be a finite number >= 0, got -0.1"),
    (dict(lambda2=float("nan")), "deal_lambda2 must be a finite number >= 0, got nan"),
    (dict(a=2.0, b=5.0), "deal_a >= deal_b"),
    (dict(b=0.5), "deal_a >= deal_b >= 1"),
    (dict(rank=0), "deal_rank must be >= 1, got 0"),
    (dict(new_rank=-1), "deal_new_rank must be >= 0, got -1"),
    (dict(scales=0), "deal_scales must be >= 1"),
    (dict(filter="gauss"), "deal_filter must be one of wavelet, haar, got 'gauss'"),
    (dict(filter_on="ba"), "deal_filter_on must be one of ab, a, b"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_options_are_method_errors_when_the_config_is_built(change, message):
    with pytest.raises(MethodError, match=re.escape(message)):
        DealConfig(**change)


@pytest.mark.parametrize("change,message", BAD)
def test_bad_flat_options_are_method_errors_before_anything_loads(change, message):
    flat = {f"deal_{k}": v for k, v in change.items()}
    with pytest.raises(MethodError, match=re.escape(message)):
        config_from({"method": "deal", "model": "/nonexistent", **flat})


def test_deal_with_the_haar_filter_runs_on_the_sequence(workspace):  # noqa: F811
    report = run(options(workspace, "deal-haar", method="deal", deal_filter="haar", deal_rank=2), progress=False,
                 log=quiet)
    assert report["per_task"][0]["summary"].startswith("trains rank-2 LoRA")
    assert report["per_task"][1]["summary"].startswith("DEAL (haar filter")
    assert report["rows"][2]["general_loss"] != report["rows"][1]["general_loss"]  # the second task changed the model


def test_per_task_scores_each_task_with_its_own_adapter(workspace):  # noqa: F811
    report = run(options(workspace, "oracle", method="per_task"), progress=False, log=quiet)
    matrix = report["matrix"]
    assert matrix[2][0] == matrix[1][0] and report["metrics"]["BWT"] == 0.0
    assert matrix[1][1] == matrix[0][1]  # task 2 before it is learned: the base model
    assert report["general_loss"][0] == report["general_loss"][2]  # the model itself never changes
    out = workspace / "oracle"
    base, saved = (AutoModelForCausalLM.from_pretrained(p) for p in (workspace / "tiny", out / "model"))
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), saved.state_dict().values()))
    assert sorted(p.parent.parent.name for p in out.glob("task-*/adapter/adapter_config.json")) == \
        ["task-1-docs", "task-2-topics"]
    adapted = PeftModel.from_pretrained(base, out / "task-1-docs" / "adapter")
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in adapted.named_parameters())


# The public code's variant (deal_variant public_code).
def haar2d_reference(a, theta):
    """Ã by the textbook transform: orthonormal one-level 2-D Haar analysis of A zero-padded to even
    sides (H A Hᵀ), θ ⊙ the approximation block, synthesis Hᵀ C H, cropped (pytorch_wavelets, mode zero)."""
    r, d = a.shape
    padded = torch.nn.functional.pad(a, (0, d % 2, 0, r % 2)).double()

    def analysis(n):  # rows 0..n/2-1: low-pass pairs, the rest: high-pass pairs
        h = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n // 2):
            h[i, 2 * i] = h[i, 2 * i + 1] = 2 ** -0.5
            h[n // 2 + i, 2 * i], h[n // 2 + i, 2 * i + 1] = 2 ** -0.5, -2 ** -0.5
        return h

    hr, hd = analysis(padded.shape[0]), analysis(padded.shape[1])
    coefficients = hr @ padded @ hd.T
    coefficients[:padded.shape[0] // 2, :padded.shape[1] // 2] *= theta.double()
    return (hr.T @ coefficients @ hd)[:r, :d]


@pytest.mark.parametrize("shape", [(8, 16), (7, 16), (8, 15), (5, 3), (1, 1)])
def test_the_haar_filter_is_the_2d_dwt_with_theta_on_the_approximation(shape):
    from adept_ext.methods.deal import Haar2dFilter

    torch.manual_seed(0)
    a = torch.randn(shape)
    haar = Haar2dFilter(shape)
    torch.testing.assert_close(haar(a), a)  # θ = 1: the identity
    with torch.no_grad():
        haar.theta.uniform_(0.0, 2.0)
    torch.testing.assert_close(haar(a).double(), haar2d_reference(a, haar.theta.detach()), atol=1e-6, rtol=0)


def public_code_task_two():
    method, model = after_first_task(variant="public_code")
    return method, model, method.prepare(model, Context(general_probe=[]))


def test_public_code_variant_trains_a_theta_and_an_mlp_with_b_frozen():
    method, model, setup = public_code_task_two()
    a_params = {id(layer.lora_A["default"].parametrizations.weight.original) for _, layer in lora_adapters(model)}
    assert {id(p) for p in setup.trainable} == a_params | {id(p) for p in method.retain + method.updates}
    assert not any(layer.lora_B["default"].weight.requires_grad for _, layer in lora_adapters(model))
    for name, layer in lora_adapters(model):  # A and B start as the last task's; θ = 1
        assert torch.equal(layer.lora_A["default"].weight, method.factors[name][0])
        assert torch.equal(layer.lora_B["default"].weight, method.factors[name][1])
    # The forward is W₀x + s·B·MLP(Ã x): the Kaiming-initialised MLP changes the model at the start.
    name, layer = lora_adapters(model)[0]
    x = torch.randn(3, layer.in_features)
    a, b = method.factors[name]
    expected = layer.base_layer(x) + layer.scaling["default"] * method.mlps[name](x @ a.T) @ b.T
    torch.testing.assert_close(layer(x), expected)
    method.loss(method.peft_model, padded_batches(n_batches=1)[0]).backward()
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in setup.trainable)


def test_public_code_variant_folds_theta_keeps_b_and_applies_the_adapter_unmerged(tmp_path):
    method, model, setup = public_code_task_two()
    base_weights = {n: p.detach().clone() for n, p in tiny_model("llama", layers=2).state_dict().items()}
    with torch.no_grad():
        for p in setup.trainable:
            p.add_(torch.randn_like(p) * 0.05)
    batches = padded_batches()
    adapted = logits(method.peft_model, batches)
    filtered = {name: layer.lora_A["default"].weight.detach().clone() for name, layer in lora_adapters(model)}
    b1 = {name: f[1].clone() for name, f in method.factors.items()}
    returned = method.end_task(model, tmp_path, {})
    assert not lora_adapters(returned)
    assert all(torch.equal(p, base_weights[n]) for n, p in returned.state_dict().items())  # W₀: nothing merged
    torch.testing.assert_close(logits(returned, batches), adapted, atol=1e-5, rtol=0)  # the hooks apply it
    for name in filtered:
        assert torch.equal(method.factors[name][0], filtered[name]) and torch.equal(method.factors[name][1], b1[name])
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "deal_adapter.safetensors")
    assert torch.equal(saved[f"{name}.lora_A"], filtered[name]) and f"{name}.mlp.fc1.weight" in saved
    # The next task discards the MLP and starts from Ã with θ = 1.
    old = method.mlps[name]
    method.prepare(returned, Context(general_probe=[]))
    assert method.mlps[name] is not old
    first, layer = lora_adapters(returned)[0]
    assert torch.equal(layer.lora_A["default"].weight, method.factors[first][0])


def test_public_code_penalties_are_norms():
    method, model, _ = public_code_task_two()
    method.config.lambda1, method.config.a, method.config.lambda2, method.config.b = 0.5, 4.0, 0.25, 2.0
    retain, update = method.penalties(model)
    thetas = sum(torch.linalg.vector_norm(t.flatten(), 4.0) for t in method.retain)  # θ = 1: n^(1/4) each
    assert float(retain) == pytest.approx(0.5 * sum(t.numel() ** 0.25 for t in method.retain), rel=1e-5)
    assert float(retain) == pytest.approx(0.5 * float(thetas), rel=1e-6)
    mlps = sum(float(torch.cat([p.flatten() for p in m.parameters()]).norm()) for m in method.mlps.values())
    assert float(update) == pytest.approx(0.25 * mlps, rel=1e-5)


def test_public_code_variant_refuses_the_paper_options():
    with pytest.raises(MethodError, match="deal_filter_on configure"):
        DealConfig(variant="public_code", filter_on="a")


def test_public_code_variant_runs_on_the_sequence_and_saves_the_adapter(workspace):  # noqa: F811
    report = run(options(workspace, "deal-public", method="deal", deal_variant="public_code", deal_rank=2),
                 progress=False, log=quiet)
    assert report["per_task"][1]["summary"].startswith("DEAL, the public code's variant")
    assert report["rows"][2]["general_loss"] != report["rows"][1]["general_loss"]
    out = workspace / "deal-public"
    assert len(list(out.glob("task-*/deal_adapter.safetensors"))) == 2
    base, saved = (AutoModelForCausalLM.from_pretrained(p) for p in (workspace / "tiny", out / "model"))
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), saved.state_dict().values()))


def test_public_code_finish_saves_the_adapter_and_reloads_to_the_hooked_models_logits(tmp_path):
    """finish() without an `out`, then the user's save_pretrained: the base weights and, beside them,
    the adapter (config.json names it); `load_adapter` on the reloaded model gives the hooked
    model's logits, after task 1 (s·B·A x) and task 2 (the MLP on the activations)."""
    import json

    from adept_ext import prepare
    from adept_ext.errors import InputError
    from adept_ext.methods.deal import ADAPTER_FILE, load_adapter

    method = get_method(DealConfig(rank=4, variant="public_code"))
    model, batches, base = tiny_model("llama", layers=2), padded_batches(), tiny_model("llama", layers=2)
    for t in range(2):
        task = prepare(model, method, lr=1e-3, total_steps=1, task_index=t, progress=False)
        with torch.no_grad():  # a trained state
            for p in task.trainable:
                p.add_(torch.randn_like(p) * 0.05)
        model = task.finish()  # out=None: nothing written by the task
        hooked = logits(model, batches)
        assert not torch.allclose(hooked, logits(base, batches), atol=1e-3)  # the adapter matters
        model.save_pretrained(tmp_path / f"task-{t}")
        saved = tmp_path / f"task-{t}"
        assert (saved / ADAPTER_FILE).is_file()
        assert json.loads((saved / "config.json").read_text())["deal_adapter"] == ADAPTER_FILE
        assert not hasattr(model.config, "deal_adapter")  # only in the saved config
        reloaded = AutoModelForCausalLM.from_pretrained(saved)
        torch.testing.assert_close(logits(load_adapter(reloaded, saved), batches), hooked, atol=1e-6, rtol=0)
        reloaded.save_pretrained(tmp_path / f"again-{t}")  # the reloaded model saves its adapter too
        again = load_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / f"again-{t}"), tmp_path / f"again-{t}")
        torch.testing.assert_close(logits(again, batches), hooked, atol=1e-6, rtol=0)
    # The next task takes the adapter off (its hooks and its saving) and trains from the method's factors.
    prepare(reloaded, method, lr=1e-3, total_steps=1, task_index=2, progress=False)
    assert "save_pretrained" not in vars(reloaded) and not hasattr(reloaded, "deal_adapter")
    with pytest.raises(InputError, match="no DEAL adapter"):
        load_adapter(tiny_model("llama", layers=2), tmp_path / "nothing")
    with pytest.raises(InputError, match="does not fit"):
        load_adapter(tiny_model("llama", layers=1), tmp_path / "task-1")
