import json

import pytest
import torch
from tiny_models import ARCHS, padded_batches, tiny_model

from adept_ext import reference, report
from adept_ext.adept import probe
from adept_ext.adept.probe import METHODS, LayerScores, layer_importance


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,max_tokens", [(a, 10**6) for a in ARCHS] + [("qwen3", 36), ("llama", 80)])
def test_bypass_equals_naive_reference(arch, max_tokens):
    model = tiny_model(arch, layers=5)
    batches = padded_batches()
    before = snapshot(model)
    scores = layer_importance(model, batches, progress=False, chunk_rows=7, max_tokens_per_call=max_tokens)
    base, variants = reference.bypass_layer_losses(model, batches)
    assert scores.tokens == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert abs(scores.base_loss - base) <= 1e-5 * abs(base)
    for got, want in zip(scores.variant_losses, variants):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    torch.testing.assert_close(torch.tensor(scores.scores), torch.tensor(variants) - base, rtol=0, atol=2e-5 * base)
    assert max(abs(s) for s in scores.scores) > 1e-3  # the layers really matter in this model
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_probe_leaves_training_mode_and_grads():
    model = tiny_model("llama").train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    layer_importance(model, padded_batches(), progress=False)
    assert model.training
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("method", ["block_influence", "taylor"])
def test_cheap_methods(method):
    model = tiny_model("qwen3", layers=4)
    batches = padded_batches()
    scores = layer_importance(model, batches, method=method, progress=False)
    assert len(scores.scores) == 4 and all(torch.isfinite(torch.tensor(scores.scores)))
    assert all(p.grad is None for p in model.parameters())
    if method == "block_influence":
        assert all(0 <= s <= 2 for s in scores.scores)
    if method == "taylor":  # first-order estimate correlates with the exact Δloss
        exact = layer_importance(model, batches, progress=False).scores
        assert torch.corrcoef(torch.tensor([scores.scores, exact]))[0, 1] > 0.5


def test_block_influence_matches_definition():
    model = tiny_model("llama", layers=3)
    batch = padded_batches(n_batches=1)[0]
    scores = layer_importance(model, [batch], method="block_influence", progress=False)
    ins = []
    hooks = [l.register_forward_hook(lambda m, a, kw, o: ins.append((a[0] if a else kw["hidden_states"], o)),
                                     with_kwargs=True)
             for l in model.model.layers]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    scored = batch["labels"][:, 1:] != -100
    scored = torch.cat([scored, torch.zeros_like(scored[:, :1])], 1)
    for l, (i, o) in enumerate(ins):
        want = (1 - torch.nn.functional.cosine_similarity(i, o, dim=-1))[scored].double().mean()
        assert abs(scores.scores[l] - float(want)) < 1e-6


def test_select_json_and_plot(tmp_path):
    model = tiny_model("llama", layers=4)
    scores = layer_importance(model, padded_batches(), progress=False)
    chosen = scores.select(2)
    assert len(chosen) == 2 and chosen == sorted(chosen)
    assert all(scores.scores[c] <= min(s for i, s in enumerate(scores.scores) if i not in chosen) for c in chosen)
    assert scores.select(0) == []
    with pytest.raises(ValueError, match="k must be"):
        scores.select(5)
    data = json.loads(scores.to_json(tmp_path / "s.json"))
    assert data["scores"] == scores.scores and (tmp_path / "s.json").exists()
    scores.plot(tmp_path / "s.png", highlight=chosen)
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="probe data is empty"):
        layer_importance(model, [], progress=False)
    batch = padded_batches(n_batches=1)[0]
    batch["labels"][:] = -100
    with pytest.raises(ValueError, match="no token to score"):
        layer_importance(model, [batch], progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        layer_importance(model, padded_batches(), method="magic", progress=False)
    with pytest.raises(ValueError, match="unsupported architecture"):
        layer_importance(torch.nn.Linear(2, 2), padded_batches(), progress=False)


@pytest.mark.parametrize("method", METHODS)
def test_progress_ticks_per_layer_not_per_batch(method, record_progress):
    model = tiny_model("llama", layers=5)
    bars = record_progress(probe, model)
    layer_importance(model, padded_batches(n_batches=2), method=method, max_tokens_per_call=36)
    (bar,) = bars
    assert bar.n == bar.total >= 2 * 5
    # the bar moves while a batch is being probed: a tick after (nearly) every layer call of the base run
    assert len(set(bar.ticks)) >= 2 * 5 - 1


def test_selected_layers_in_json_and_plot_legend(tmp_path, monkeypatch):
    scores = layer_importance(tiny_model("llama", layers=4), padded_batches(), progress=False)
    chosen = scores.select(2)
    data = json.loads(scores.to_json(tmp_path / "s.json", selected=chosen))
    assert data["selected"] == chosen and json.loads((tmp_path / "s.json").read_text())["selected"] == chosen
    assert LayerScores(**data).selected == chosen  # the JSON loads back
    with pytest.raises(ValueError, match="selected layers"):
        scores.to_json(selected=[4])
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig))
    scores.plot(tmp_path / "s.png")  # highlights `selected` by default
    (legend,) = [ax.get_legend() for ax in figures[0].axes]
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == [f"selected: layers {chosen[0]}, {chosen[1]}", "other layers"]


def test_batches_without_labels_or_mask_score_every_token():
    model = tiny_model("llama", layers=2)
    batch = padded_batches(n_batches=1)[0]
    full = {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"])}
    bare = {"input_ids": batch["input_ids"]}
    a = layer_importance(model, [full], progress=False)
    b = layer_importance(model, [bare], progress=False)
    assert a.scores == b.scores and a.tokens == b.tokens == batch["input_ids"].numel() - batch["input_ids"].shape[0]
