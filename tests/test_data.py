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


def test_packed_blocks_and_labels(tokenizer):
    texts = ["hello world " * 30, "short one", "another text " * 10]
    blocks = data.token_blocks(texts, tokenizer, block_len=16)
    ids, mask, labels = blocks["input_ids"], blocks["attention_mask"], blocks["labels"]
    stream = [t for d in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in d + [tokenizer.eos_token_id]]
    assert ids[mask == 1].tolist() == stream
    assert (mask[:-1] == 1).all() and (labels[mask == 0] == -100).all() and (labels[mask == 1] == ids[mask == 1]).all()


def test_unpacked_blocks_pad_each_document(tokenizer):
    blocks = data.token_blocks(["a b c d e f g h i j k l m n o p q", "x y"], tokenizer, block_len=8, pack=False)
    assert (blocks["attention_mask"].sum(1) >= 2).all() and (blocks["attention_mask"][:, 0] == 1).all()


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
