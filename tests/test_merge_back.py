"""Merging back toward the start (adept_ext/merge_back.py, run --merge-back)."""
import json

import pytest
import torch
from tiny_models import tiny_model, write_run_workspace
from transformers import AutoModelForCausalLM

from adept_ext import merge_back
from adept_ext.errors import RunError
from adept_ext.train import config_from, run


def test_alpha_0_is_the_start_and_1_the_trained_model_bit_for_bit():
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(True)
    start = merge_back.start_weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    merger = merge_back.MergeBack(model, start)
    merger.set(0.0)
    assert all(torch.equal(p, start[name]) for name, p in model.named_parameters())
    merger.set(1.0)
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())
    merger.set(0.3)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, start[name] + 0.3 * (trained[name] - start[name]), rtol=0, atol=1e-6)


def test_lines_grows_alpha_linearly_with_depth():
    model = tiny_model("llama", layers=5)
    alphas = merge_back.layer_alphas(model, 0.8, "lines", alpha_min=0.2)
    for layer in range(5):
        expected = 0.2 + 0.6 * layer / 4
        got = [a for name, a in alphas.items() if name.startswith(f"model.layers.{layer}.")]
        assert len(got) == 9 and got == pytest.approx([expected] * 9), layer
    assert alphas["model.embed_tokens.weight"] == 0.2
    assert alphas["lm_head.weight"] == alphas["model.norm.weight"] == 0.8
    assert set(merge_back.layer_alphas(model, 0.8).values()) == {0.8}


def test_auto_takes_the_largest_alpha_within_the_forgetting_bound():
    front = [{"alpha": a, "general_delta": d} for a, d in
             [(0.0, 0.0), (0.25, -0.01), (0.5, 0.004), (0.75, 0.02), (1.0, 0.09)]]
    assert merge_back.choose_alpha(front, 0.0) == 0.25
    assert merge_back.choose_alpha(front, 0.005) == 0.5
    assert merge_back.choose_alpha(front, 1.0) == 1.0
    assert merge_back.choose_alpha([{"alpha": 0.5, "general_delta": 0.1}], 0.0) == 0.0


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("merge"))


def options(ws, out, **kw):
    return config_from(dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                            out=str(ws / out), k=2, max_length=32, batch_size=2, steps=3, warmup_steps=1,
                            probe_blocks=2, eval_blocks=2, eval_every=0, save_every=0, lr=1e-2, **kw))


def saved(ws, out):
    return AutoModelForCausalLM.from_pretrained(ws / out / "model").state_dict()


@pytest.mark.parametrize("method,extra", [("lora", {}), ("lora", {"bf16": "on", "frozen_dtype": "bfloat16"}),
                                          ("adept", {})], ids=["lora", "lora-frozen-bf16", "adept"])
def test_merge_back_0_saves_the_start(workspace, method, extra):
    """α = 0: LoRA's saved weights are the base's bit for bit (also with its frozen weights held in
    bfloat16: merged exact on the host); ADEPT's copies are at their function-preserving start, so the
    merged model's general loss is the base's."""
    name = f"{method}-0" + "".join(f"-{k}" for k in extra)
    report = run(options(workspace, name, method=method, merge_back="0", **extra), progress=False,
                 log=lambda *a: None)
    assert report["merge_back"]["alpha"] == 0.0 and report["merge_back"]["trained"] != report["final"]
    assert report["final"]["general_loss"] == pytest.approx(report["base"]["general_loss"], abs=1e-4 if extra else 1e-5)
    assert report["merge_back"]["trained"]["domain_loss"] < report["base"]["domain_loss"]  # it did learn
    if method == "lora":
        base = AutoModelForCausalLM.from_pretrained(workspace / "tiny").state_dict()
        got = saved(workspace, name)
        assert got.keys() == base.keys() and all(torch.equal(got[k], base[k]) for k in base)


def test_auto_scores_the_grid_and_keeps_the_forgetting_bound(workspace, monkeypatch):
    from adept_ext.training import one_domain

    real_evaluate, evaluated = one_domain.evaluate, []

    def counted(*args, **kwargs):
        evaluated.append(args[1])
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(one_domain, "evaluate", counted)
    report = run(options(workspace, "full-auto", method="full", merge_back="auto", merge_back_schedule="lines",
                         merge_back_min=0.2, max_forgetting=0.05), progress=False, log=lambda *a: None)
    mb = report["merge_back"]
    assert [p["alpha"] for p in mb["front"]] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert len(evaluated) == 2 * (2 + len(mb["front"]))  # base, trained, each α once: the chosen not again
    within = [p["alpha"] for p in mb["front"] if p["general_delta"] <= 0.05]
    assert mb["alpha"] == max(within, default=0.0)
    assert report["final"]["general_loss"] == pytest.approx(
        next(p["general_loss"] for p in mb["front"] if p["alpha"] == mb["alpha"]), rel=1e-6)
    assert report["forgetting_general_delta"] <= 0.05 + 1e-6
    out = workspace / "full-auto"
    assert (out / "merge_back.png").exists() and "Merged back toward the start" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["merge_back"]["alpha"] == mb["alpha"]


@pytest.mark.parametrize("extra,message", [
    ({"merge_back": "2"}, "merge_back must be a number in [0, 1] or auto"),
    ({"merge_back": "half"}, "merge_back must be a number in [0, 1] or auto"),
    ({"merge_back": "0.5", "merge_back_schedule": "cubic"}, "merge_back_schedule must be one of uniform, lines"),
    ({"merge_back": "0.5", "max_forgetting": 0.1}, "needs --merge-back auto"),
    ({"merge_back": "0.5", "merge_back_min": 0.2}, "needs that schedule"),
    ({"merge_back": "0.1", "merge_back_schedule": "lines", "merge_back_min": 0.2}, "is below --merge-back-min"),
])
def test_bad_merge_back_options_are_refused(workspace, extra, message):
    with pytest.raises(RunError, match=message.replace("[", r"\[").replace("]", r"\]")):
        options(workspace, "refused", method="full", **extra)
