"""LayerTracer diagnostics against naive one-variant-at-a-time references on tiny real models."""
import json

import pytest
import torch
from tiny_models import ARCHS, padded_batches, tiny_model

from adept_ext import reference
from adept_ext.lens import Diagnosis, allocate, diagnose, layer_sensitivity, logit_lens
from adept_ext.lens.inputs import context_query_task, fewshot_topic_task
from adept_ext.adept.probe import layer_importance


def composite_batches(context_len=5, seed=1):
    """Padded batches whose first `context_len` tokens are the context; every query position is scored."""
    out = []
    for b in padded_batches(seed=seed):
        t = b["input_ids"].shape[1]
        context = (torch.arange(t) < context_len).expand(b["input_ids"].shape[0], t).clone()
        out.append({**b, "context_mask": context})
    return out


def query_positions(batch):
    return batch["attention_mask"].bool() & ~batch["context_mask"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logit_lens_equals_naive_reference(arch):
    model = tiny_model(arch, layers=5)
    batches = padded_batches()
    for b in batches:  # score a few positions per row, including the last attended one
        b["score_mask"] = b["attention_mask"].bool() & (torch.arange(b["input_ids"].shape[1]) % 3 == 1)
    lens = logit_lens(model, batches, chunk_rows=3, progress=False)
    naive = torch.cat([reference.logit_lens_task_probs(model, b, b["score_mask"]) for b in batches], dim=1)
    want = naive.mean(1)
    assert lens.positions == naive.shape[1]
    torch.testing.assert_close(torch.tensor([lens.p_task_embeddings] + lens.p_task, dtype=torch.float64), want,
                               rtol=1e-5, atol=1e-7)
    # the last layer is the model's own output distribution, normed once: P_t(L-1) = max prob
    final = torch.cat([model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[b["score_mask"]]
                       .double().softmax(-1).amax(-1) for b in batches])
    assert abs(lens.p_task[-1] - final.mean().item()) <= 1e-5 * final.mean().item()
    before = [lens.p_task_embeddings] + lens.p_task[:-1]
    assert lens.ratio == pytest.approx([(p - q) / (q + 1e-6) for p, q in zip(lens.p_task, before)])
    assert lens.execution_layers == [i for i, r in enumerate(lens.ratio) if r > 0]
    particle = lens.task_particle
    assert (lens.p_task[particle] >= 0.5 * lens.p_task[-1]
            and all(p < 0.5 * lens.p_task[-1] for p in lens.p_task[:particle]))


@pytest.mark.parametrize("arch,attn,max_tokens", [(a, "sdpa" if a != "gemma2" else "eager", 10**6) for a in ARCHS] +
                         [("llama", "eager", 10**6), ("qwen3", "eager", 40), ("mistral", "sdpa", 36)])
def test_layer_sensitivity_equals_naive_reference(arch, attn, max_tokens):
    model = tiny_model(arch, layers=5)
    model.set_attn_implementation(attn)
    batches = composite_batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sens = layer_sensitivity(model, batches, max_tokens_per_call=max_tokens, chunk_rows=4, progress=False)
    naive = torch.cat([reference.context_masked_js(model, b, b["context_mask"], query_positions(b)) for b in batches],
                      dim=1)
    assert sens.positions == naive.shape[1]
    want = naive.mean(1)
    assert (want > 1e-6).all()  # masking the context really changes the output at every layer
    torch.testing.assert_close(torch.tensor(sens.js, dtype=torch.float64), want, rtol=1e-5, atol=0)
    assert sens.delta_js[0] is None
    assert sens.delta_js[1:] == pytest.approx([(j - i) / (i + 1e-6) for i, j in zip(sens.js, sens.js[1:])])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_layer_sensitivity_in_float64_equals_the_reference_to_rounding():
    """In float64 the engine and the naive loop agree to ~1e-13: the fp32 differences are rounding."""
    model = tiny_model("qwen3", layers=5).double()
    batches = composite_batches()
    sens = layer_sensitivity(model, batches, max_tokens_per_call=40, progress=False)
    naive = torch.cat([reference.context_masked_js(model, b, b["context_mask"], query_positions(b)) for b in batches],
                      dim=1).mean(1)
    torch.testing.assert_close(torch.tensor(sens.js, dtype=torch.float64), naive, rtol=1e-10, atol=0)


def test_sensitivity_with_unpadded_batches_and_explicit_masks():
    """sdpa passes no mask to the layers when nothing is padded; the perturbation must still apply."""
    model = tiny_model("llama", layers=3)
    ids = torch.randint(2, 97, (2, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    context = torch.zeros(2, 10, dtype=torch.bool)
    context[:, :4] = True
    sens = layer_sensitivity(model, [batch], context_mask=[context], progress=False)
    naive = reference.context_masked_js(model, batch, context, ~context).mean(1)
    torch.testing.assert_close(torch.tensor(sens.js, dtype=torch.float64), naive, rtol=1e-5, atol=0)


def test_context_positions_are_unaffected_by_the_perturbation():
    model = tiny_model("qwen3", layers=4)
    batches = composite_batches()
    for b in batches:  # score only context positions: causal attention means nothing there can change
        b["score_mask"] = b["context_mask"].clone()
    with pytest.raises(ValueError, match="no scored query position"):
        layer_sensitivity(model, batches, progress=False)


@pytest.mark.parametrize("change,message", [
    (lambda bs: [{k: v for k, v in b.items() if k != "context_mask"} for b in bs], "has no context_mask"),
    (lambda bs: [{**b, "context_mask": torch.zeros_like(b["context_mask"])} for b in bs], "marks no token"),
    (lambda bs: [{**b, "context_mask": b["context_mask"][:, :3]} for b in bs], "context_mask has shape"),
    (lambda bs: [], "no batches"),
])
def test_sensitivity_errors(change, message):
    with pytest.raises(ValueError, match=message):
        layer_sensitivity(tiny_model("llama"), change(composite_batches()), progress=False)


def test_sensitivity_refuses_attention_it_cannot_mask():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        layer_sensitivity(model, composite_batches(), progress=False)


def test_logit_lens_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no batches"):
        logit_lens(model, [], progress=False)
    with pytest.raises(ValueError, match="no scored position"):
        logit_lens(model, [{**b, "score_mask": torch.zeros_like(b["attention_mask"])} for b in padded_batches()],
                   progress=False)
    with pytest.raises(ValueError, match="threshold"):
        logit_lens(model, padded_batches(), threshold=0, progress=False)


def test_allocation_rules():
    model = tiny_model("llama", layers=6)
    assert allocate(model) == [0, 1, 2]
    assert allocate(6, "freeze_shallow", boundary=4) == [4, 5]
    diagnosis = diagnose(model, composite_batches(), progress=False)
    js = diagnosis.sensitivity.js
    last_sensitive = max(i for i, j in enumerate(js) if j >= 0.25 * max(js))
    expect = min(max(min(diagnosis.lens.task_particle, last_sensitive + 1), 1), 5)
    assert allocate(model, diagnosis=diagnosis) == list(range(expect))
    # a hand-made profile: evidence integrated from layer 4, sensitive up to layer 2 -> train [0, 3)
    diagnosis.lens.task_particle, diagnosis.sensitivity.js = 4, [0.1, 0.3, 0.2, 0.01, 0.02, 0.01]
    assert allocate(model, diagnosis=diagnosis) == [0, 1, 2]
    diagnosis.lens.task_particle = 2
    assert allocate(model, diagnosis=diagnosis) == [0, 1]
    assert allocate(model, "freeze_shallow", diagnosis=diagnosis) == [2, 3, 4, 5]
    for bad in (0, 6):
        with pytest.raises(ValueError, match="boundary"):
            allocate(model, boundary=bad)
    with pytest.raises(ValueError, match="unknown strategy"):
        allocate(model, "random")


def test_diagnosis_json_and_plot(tmp_path):
    model = tiny_model("qwen3", layers=4)
    scores = layer_importance(model, padded_batches(), progress=False)
    diagnosis = diagnose(model, composite_batches(), importance=scores, progress=False)
    diagnosis.to_json(tmp_path / "d.json")
    diagnosis.plot(tmp_path / "d.png")
    saved = json.loads((tmp_path / "d.json").read_text())
    assert len(saved["lens"]["p_task"]) == len(saved["sensitivity"]["js"]) == len(saved["importance"]["scores"]) == 4
    assert (tmp_path / "d.png").stat().st_size > 10_000
    assert Diagnosis.from_json(tmp_path / "d.json") == diagnosis


def test_fewshot_topic_task_structure():
    from adept_ext.models import load_model

    tokenizer = load_model("smollm2-135m")[1]
    batches = fewshot_topic_task(tokenizer, n_queries=5, shots=3, words=12, batch_size=2, seed=3)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2, 1]
    for b in batches:
        lens = b["attention_mask"].sum(1)
        for row in range(b["input_ids"].shape[0]):
            assert b["score_mask"][row].nonzero().flatten().tolist() == [lens[row] - 1]
            context = tokenizer.decode(b["input_ids"][row][b["context_mask"][row]])
            query = tokenizer.decode(b["input_ids"][row][~b["context_mask"][row] & b["attention_mask"][row].bool()])
            assert context.count("Topic:") == 3 and query.startswith("Article:") and query.endswith("\nTopic:")
            answer = tokenizer.decode(b["answer_ids"][row])
            assert answer.strip() in ("business", "entertainment", "politics", "sports", "tech")
    again = fewshot_topic_task(tokenizer, n_queries=5, shots=3, words=12, batch_size=2, seed=3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))


def test_context_query_task():
    blocks = {"input_ids": torch.arange(20).view(2, 10), "attention_mask": torch.ones(2, 10, dtype=torch.long),
              "labels": torch.arange(20).view(2, 10)}
    blocks["attention_mask"][1, 7:] = 0
    blocks["labels"][1, 7:] = -100
    (b,) = context_query_task([blocks], context_len=4)
    assert b["context_mask"][:, :4].all() and not b["context_mask"][:, 4:].any()
    assert b["score_mask"][0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    assert b["score_mask"][1].nonzero().flatten().tolist() == [4, 5]
    with pytest.raises(ValueError, match="longer than the context"):
        context_query_task([blocks], context_len=10)


def test_sensitivity_progress_ticks_per_layer(record_progress):
    import adept_ext.lens.diagnosis as lens_module

    model = tiny_model("llama", layers=5)
    bars = record_progress(lens_module, model)
    layer_sensitivity(model, composite_batches(), max_tokens_per_call=36)
    (bar,) = bars
    assert bar.n == bar.total == 2 * 5 * 2  # two batches: each layer's masked variant, then its JS
    assert len(set(bar.ticks)) >= 2 * 5  # the bar moves during a batch's forward, not only after it
