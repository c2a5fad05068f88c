"""DEAL (wavelet-kernel retention + controlled update of the previous LoRA, merged after each
task) and the per_task oracle: exact start of a task, merge equality, option checks, and runs on
the continual runner."""
import re

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from adept_ext.continual import config_from, run
from adept_ext.methods import Context, DealConfig, MethodError, get_method
from adept_ext.methods.lora import lora_adapters
from test_continual import options, quiet, workspace  # noqa: F401 (the module-scoped workspace fixture)
from tiny_models import padded_batches, tiny_model


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
    torch.testing.assert_close(logits(plain, batches), unmerged, atol=1e-5, rtol=0)
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
