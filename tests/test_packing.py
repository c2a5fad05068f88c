"""`--packing` (adept_ext/data/packing.py): best-fit decreasing, document rows, packed rows whose loss and
gradients equal those of the same documents unpacked on every architecture, and both runners with it."""
import json
import random

import numpy as np
import pytest
import torch
from tiny_models import ARCHS, tiny_model, write_sequence_workspace

from adept_ext import data
from adept_ext.data.packing import DocumentRows, PackedRows, best_fit_decreasing, packed_view
from adept_ext.errors import InputError, RunError
from adept_ext.lm_loss import hf_head_reason, next_token_loss
from adept_ext.models.packed_attention import check_packing, packing_reason

WIDTH = 16


def random_documents(n=14, vocab=97, seed=0):
    """Documents of 1 to 2·WIDTH + 3 tokens (ids 2..vocab-1; EOS is 1, pad 0): some longer than a row."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 2 * WIDTH + 3))] for _ in range(n)]


def test_best_fit_decreasing_places_every_item_once_within_capacity_and_is_deterministic():
    rng = random.Random(0)
    for trial in range(50):
        capacity = rng.randint(4, 64)
        lengths = [rng.randint(0, capacity) for _ in range(rng.randint(0, 200))]
        bins = best_fit_decreasing(lengths, capacity)
        placed = sorted(i for b in bins for i in b)
        assert placed == [i for i, n in enumerate(lengths) if n > 0]  # every non-empty item once
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        assert bins == best_fit_decreasing(lengths, capacity)
        # best fit never leaves two bins that one could hold: at most one bin is at most half full
        assert sum(2 * sum(lengths[i] for i in b) <= capacity for b in bins) <= 1


def naive_best_fit_decreasing(lengths, capacity):
    """The definition, O(n · bins): each item, longest first, into the fitting bin with the least room."""
    bins, rooms = [], []
    for i in sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[b].append(i)
        rooms[b] -= lengths[i]
    return bins


def test_best_fit_decreasing_puts_an_item_where_the_least_room_is_left():
    # 6 -> bin 0 (room 4), 5 -> bin 1 (room 5), 4 -> bin 0 (fits exactly; worst fit: bin 1), 3 and 2 -> bin 1
    assert best_fit_decreasing([5, 6, 4, 3, 2], 10) == [[1, 2], [0, 3, 4]]
    rng = random.Random(1)
    for _ in range(200):
        capacity = rng.randint(2, 40)
        lengths = [rng.randint(0, capacity) for _ in range(rng.randint(0, 60))]
        assert best_fit_decreasing(lengths, capacity) == naive_best_fit_decreasing(lengths, capacity)
    with pytest.raises(InputError, match="more than a row of 10: split it first"):
        best_fit_decreasing([4, 11], 10)


def test_document_rows_split_a_document_only_when_it_is_longer_than_a_row():
    docs = [[5] * (WIDTH - 1), [6] * (WIDTH + 1), [7] * (2 * WIDTH + 2), [8]]  # + EOS: 16, 18, 35, 2 tokens
    rows = DocumentRows.of(docs, 1, WIDTH, 0)
    assert rows.lengths.tolist() == [WIDTH, WIDTH, 2, WIDTH, WIDTH, 3, 2]
    got = rows.rows(np.arange(len(rows)))
    assert got["attention_mask"].sum(1).tolist() == rows.lengths.tolist()
    assert torch.equal(got["labels"], got["input_ids"].masked_fill(got["attention_mask"] == 0, -100))
    tokens = torch.cat([got["input_ids"][i, :n] for i, n in enumerate(rows.lengths)]).tolist()
    assert tokens == [t for d in docs for t in (*d, 1)]  # the wrapped stream's tokens, cut at document ends
    assert DocumentRows.of([[5] * (WIDTH - 1) + [6], [9]], 1, WIDTH, 0).lengths.tolist() == [WIDTH, 1 + 1]
    assert len(DocumentRows.of([[5] * WIDTH], 1, WIDTH, 0)) == 1  # the split-off EOS alone is dropped


def packed_and_unpacked(docs=None, width=WIDTH):
    rows = DocumentRows.of(docs or random_documents(), 1, width, 0)
    packed = PackedRows(rows, width, 0)
    return packed, packed.rows(np.arange(len(packed))), rows.rows(np.arange(len(rows)))


def test_packed_rows_hold_every_document_once_with_restarting_positions_and_no_label_across_a_boundary():
    packed, batch, unpacked = packed_and_unpacked()
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape[1] == WIDTH
    assert len(packed) < len(packed.lengths)  # fewer rows than documents
    starts = batch["position_ids"] == 0
    assert (batch["labels"][starts] == -100).all()  # a document's first token is never a target
    # every position continues its document's or restarts at 0
    step = batch["position_ids"][:, 1:] - batch["position_ids"][:, :-1]
    assert ((step == 1) | (batch["position_ids"][:, 1:] == 0)).all()
    segments = [(r, s) for r in range(len(packed)) for s in np.split(np.arange(WIDTH), np.nonzero(
        starts[r].numpy())[0][1:])]
    pieces = sorted(batch["input_ids"][r, s].tolist() for r, s in segments if (batch["labels"][r, s] != -100).any())
    expected = sorted(unpacked["input_ids"][i, :n].tolist() for i, n in enumerate(packed.lengths))
    assert pieces == expected  # each packed segment is one whole document piece (and padding tails score nothing)
    assert int((batch["labels"][:, 1:] != -100).sum()) == int((unpacked["labels"][:, 1:] != -100).sum())


def instruction_rows():
    prompts = [[3, 4, 5], [6] * 7, [8, 9], [10] * 11]
    answers = [[11, 12], [13], [14, 15, 16], [17]]
    rows = [p + a + [1] for p, a in zip(prompts, answers)]
    ids, mask = data.pad_rows(rows, 0, WIDTH)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        labels[i, len(p):len(p) + len(a) + 1] = ids[i, len(p):len(p) + len(a) + 1]
    return data.TensorBlocks({"input_ids": ids, "attention_mask": mask, "labels": labels})


def test_instruction_examples_pack_with_their_prompt_unlabelled():
    rows = instruction_rows()
    packed = PackedRows(rows, WIDTH, 0)
    batch = packed.rows(np.arange(len(packed)))
    assert packed.bins == [[3], [1, 0], [2]]  # rows of 13, 9, 6, 6 tokens: the 6 fills the 9's row first
    assert sorted(batch["labels"][batch["labels"] != -100].tolist()) == sorted(
        rows.blocks["labels"][rows.blocks["labels"] != -100].tolist())


def loss_and_grads(model, batch, implementation, n):
    model.zero_grad()
    loss = next_token_loss(model, batch, implementation, num_items=n)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


ATTENTION_CASES = [(arch, None) for arch in ARCHS] + [("llama", "eager"), ("qwen3", "eager"), ("mixtral", "eager")]


@pytest.mark.parametrize("arch,attention", ATTENTION_CASES, ids=[f"{a}-{b or 'default'}" for a, b in ATTENTION_CASES])
def test_packed_loss_and_gradients_equal_the_unpacked_documents(arch, attention):
    """fp32, 1e-5: the same documents packed (block-diagonal attention through restarting position ids,
    sliding windows and MoE routing included) and one padded row each, through the fused loss and HF's."""
    _, packed, unpacked = packed_and_unpacked()
    n = int((unpacked["labels"][:, 1:] != -100).sum())
    model = tiny_model(arch).train()
    if attention:
        model.set_attn_implementation(attention)
    assert packing_reason(model) is None
    for implementation in ("fused", "hf") if hf_head_reason(model) is None else ("hf",):
        (loss_p, grad_p), (loss_u, grad_u) = (loss_and_grads(model, b, implementation, n) for b in (packed, unpacked))
        assert abs(float(loss_p - loss_u)) <= 1e-5 * float(loss_u), (implementation, float(loss_p), float(loss_u))
        assert float((grad_p - grad_u).abs().max()) <= 1e-5 * float(grad_u.abs().max()), implementation


def ignore_position_ids(model):
    """An architecture whose forward drops position ids (so packed documents attend to each other)."""
    def drop(module, args, kwargs):
        kwargs.pop("position_ids", None)
        return args, kwargs

    model.model.register_forward_pre_hook(drop, with_kwargs=True)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_packing_check_passes_every_architecture_and_refuses_attention_across_documents(dtype):
    """Independent of precision: every architecture held in `dtype` (bf16's rounding refused them under a
    tolerance on packed vs alone logits) passes; dropping the position ids (dense causal attention over
    each row) is refused, in both precisions."""
    autocast = torch.bfloat16 if dtype == torch.bfloat16 else None
    for arch in ARCHS:
        assert packing_reason(tiny_model(arch).to(dtype), 3, autocast) is None, arch
    model = ignore_position_ids(tiny_model("llama").to(dtype))
    assert "lets packed documents see each other" in packing_reason(model, 2, autocast)
    with pytest.raises(InputError, match="--packing cannot be used with this model"):
        check_packing(model, 2, autocast)


def rows_or_varlen_flash(module, query, key, value, attention_mask, scaling=None, position_ids=None, **kwargs):
    """Flash attention's dispatch in transformers (`_flash_attention_forward` without a mask): per document
    (its variable-length path) for one row whose position ids restart, else dense causal over each row."""
    batch, _, length, _ = query.shape
    segment = torch.zeros(batch, length, dtype=torch.long)
    if position_ids is not None and batch == 1:
        segment = (position_ids == 0).long().cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & (segment[:, :, None] == segment[:, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None],
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash_like():
    """A tiny Llama whose attention dispatches like flash attention (registered as "rows_or_varlen")."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register("rows_or_varlen", rows_or_varlen_flash)
    AttentionMaskInterface.register("rows_or_varlen", flash_attention_mask)
    model = tiny_model("llama").train()
    model.set_attn_implementation("rows_or_varlen")
    return model


def test_packed_rows_are_flattened_into_one_row_for_flash_attention(flash_like, monkeypatch):
    """Several packed rows under a flash-like backend train as one flattened row [1, B·L], so the loss
    and gradients equal the unpacked documents'; left as B rows they attend across documents (refused)."""
    from adept_ext.models import packed_attention

    _, packed, unpacked = packed_and_unpacked()
    assert packed["input_ids"].shape[0] > 1
    n = int((unpacked["labels"][:, 1:] != -100).sum())
    assert packed_attention.packed_layout(flash_like, packed)["input_ids"].shape == (1, packed["input_ids"].numel())
    assert packed_attention.packed_layout(tiny_model("llama"), packed) is packed  # sdpa: each row masks its documents
    assert packing_reason(flash_like) is None
    for implementation in ("fused", "hf"):
        (loss_p, grad_p), (loss_u, grad_u) = (loss_and_grads(flash_like, b, implementation, n)
                                              for b in (packed, unpacked))
        assert abs(float(loss_p - loss_u)) <= 1e-5 * float(loss_u), implementation
        assert float((grad_p - grad_u).abs().max()) <= 1e-5 * float(grad_u.abs().max()), implementation
    monkeypatch.setattr(packed_attention, "packed_layout", lambda model, batch: batch)  # rows as they are: refused
    assert "lets packed documents see each other" in packing_reason(flash_like)


def test_a_large_corpus_gives_the_document_rows_of_the_same_texts_in_memory(tmp_path, monkeypatch):
    from adept_ext.models import load_model

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = load_model("smollm2-135m")[1]
    texts = data.load_texts("python-docs")[:5]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    for _ in range(2):  # written, then read from the cache
        rows = data.corpus_blocks(str(tmp_path / "c.jsonl"), tokenizer, 64, documents=True)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        in_memory = DocumentRows.of(ids, tokenizer.eos_token_id, 64, data.pad_id(tokenizer))
        assert isinstance(rows.stream, np.memmap) and rows.lengths.tolist() == in_memory.lengths.tolist()
        everything = np.arange(len(rows))
        assert all(torch.equal(a, b) for a, b in zip(rows.rows(everything).values(),
                                                     in_memory.rows(everything).values()))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_sequence_workspace(tmp_path_factory.mktemp("packing"))


def run_dict(ws, out, **kw):
    return {**dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                   out=str(ws / out), method="full", max_length=64, batch_size=2, steps=3, warmup_steps=1,
                   probe_blocks=2, eval_blocks=3, eval_every=0, save_every=0, lr=1e-3, packing=True), **kw}


def run_options(ws, out, **kw):
    from adept_ext.train import config_from

    return config_from(run_dict(ws, out, **kw))


def test_run_trains_on_packed_rows_and_evaluates_one_document_per_row(workspace, monkeypatch):
    import adept_ext.methods.base as base
    from adept_ext.data import Corpora
    from adept_ext.train import run

    cfg = run_options(workspace, "run", mix_general=0.25)
    from adept_ext.models import load_model

    tokenizer = load_model(cfg.model)[1]
    corpora = Corpora(cfg, tokenizer)
    batch = corpora.domain_train[0]
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert (batch["labels"][batch["position_ids"] == 0] == -100).all()
    assert all("attention_mask" in b and "position_ids" not in b for b in corpora.domain_eval + corpora.general_probe)
    seen = []
    loss = base.Method.loss
    monkeypatch.setattr(base.Method, "loss", lambda self, model, batch, *a, **k: seen.append(set(batch)) or
                        loss(self, model, batch, *a, **k))
    report = run(cfg, progress=False, log=lambda *a: None)
    assert seen and all(keys == {"input_ids", "labels", "position_ids"} for keys in seen)
    assert report["config"]["packing"] and np.isfinite(report["final"]["domain_loss"])


def test_continual_packs_text_and_instruction_tasks_with_replay(workspace):
    from adept_ext.continual import config_from, run

    cfg = config_from(dict(model=str(workspace / "tiny"), general=str(workspace / "general"),
                           tasks=f"{workspace / 'docs.txt'},{workspace / 'topics.jsonl'}", out=str(workspace / "seq"),
                           method="replay", max_length=64, batch_size=2, steps=2, warmup_steps=1, probe_blocks=2,
                           eval_blocks=3, save_every=0, lr=1e-3, replay_fraction=0.5, mix_general=0.2, packing=True))
    report = run(cfg, progress=False, log=lambda *a: None)
    assert len(report["tasks"]) == 2 and all(np.isfinite(s) for s in report["matrix"][-1])


def test_packing_is_refused_with_streaming_and_on_a_model_that_crosses_documents(workspace, monkeypatch):
    import adept_ext.train as train

    with pytest.raises(RunError, match="--packing reads whole documents"):
        run_options(workspace, "streamed", streaming=True)
    loaded = train.load_model
    monkeypatch.setattr(train, "load_model", lambda *a, **k: (ignore_position_ids(loaded(*a, **k)[0]),
                                                              loaded(*a, **k)[1]))
    with pytest.raises(RunError, match="--packing cannot be used with this model"):
        train.run(run_options(workspace, "refused"), progress=False, log=lambda *a: None)
    assert not (workspace / "refused").exists()


def test_packed_view_shuffles_the_packed_rows_by_seed():
    rows = DocumentRows.of(random_documents(40), 1, WIDTH, 0)
    a, b, c = (packed_view(rows, WIDTH, 0, seed) for seed in (0, 0, 1))
    assert a.indices.tolist() == b.indices.tolist() != c.indices.tolist()
    assert sorted(a.indices.tolist()) == list(range(len(PackedRows(rows, WIDTH, 0))))


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_packed_run_on_two_ranks_equals_one_process_with_the_same_global_batch(workspace, tmp_path, engine):
    """2 gloo ranks x grad_accum 1 under DDP or FSDP2 train on the packed rows one process takes with
    grad_accum 2 (position ids travel with each rank's batches): the losses agree to 1e-4 relative."""
    from test_distributed import _assert_like_one_process, _run_ranks

    from adept_ext.train import run

    options = run_dict(workspace, str(tmp_path / engine), mix_general=0.25, eval_every=2)
    single = run(run_options(workspace, str(tmp_path / "single"), mix_general=0.25, eval_every=2, grad_accum=2,
                             loss_implementation="hf"), progress=False, log=lambda *a: None)
    _assert_like_one_process(_run_ranks({**options, "parallel": engine}, tmp_path), single)


def test_the_benchmark_counts_real_tokens_of_every_kind_of_row():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from bench import packing as bench_packing

    docs = random_documents()
    rows = DocumentRows.of(docs, 1, WIDTH, 0)
    tokens = sum(len(d) + 1 for d in docs) - sum(1 for d in docs if (len(d) + 1) % WIDTH == 1)  # lone EOS dropped
    wrapped = data.PackedBlocks(data.pack_stream(docs, 1), WIDTH, 0)
    for source in (rows, PackedRows(rows, WIDTH, 0), wrapped):
        got = bench_packing.real_tokens(source, np.arange(len(source)))
        assert got == (tokens if source is not wrapped else len(wrapped.stream))
        assert bench_packing.padding_fraction(source, WIDTH) == pytest.approx(1 - got / (len(source) * WIDTH))
    results = {"model": "m", "max_length": WIDTH, "batch": 2, "data": {"text": {"packed": {
        "rows": 3, "padding_fraction": 0.1, "tokens_per_s": 5.0}}}}
    assert [(r["provider"], r["metric"]) for r in bench_packing.rows(results)] == [
        ("text: packed", "rows"), ("text: packed", "padding_fraction"), ("text: packed", "tokens_per_s")]
