"""Corpora through Hugging Face datasets (adept_ext.data.large_corpus): the blocks equal the in-memory
path's, the caches are keyed by the files' contents, streaming reads blocks in corpus order, and
bad corpora are clear errors."""
import itertools
import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from adept_ext import data
from adept_ext.data import large_corpus
from adept_ext.errors import RunError
from adept_ext.data import Corpora
from adept_ext.train import RunConfig, config_from


@pytest.fixture(scope="module")
def tokenizer():
    from adept_ext.models import load_model

    return load_model("smollm2-135m")[1]


@pytest.fixture
def folder(tmp_path):
    """A nested folder of .txt, .md and .jsonl documents, with blank documents to skip."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    texts = data.load_texts("python-docs")[:5]
    (root / "a.txt").write_text(texts[0])
    (root / "b.md").write_text(texts[1])
    (root / "sub" / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in (texts[2], "   ", texts[3]))
                                          + "\n\n")
    (root / "sub" / "d.txt").write_text(texts[4])
    (root / "empty.txt").write_text("\n")
    (root / "ignored.csv").write_text("not,a,corpus")
    return root


def _equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("block_len", [2, 7, 64])
def test_file_folder_blocks_equal_the_in_memory_path(tokenizer, folder, block_len):
    expected = data.token_blocks(data.load_texts(str(folder)), tokenizer, block_len)
    blocks = data.corpus_blocks(str(folder), tokenizer, block_len)
    assert isinstance(blocks.stream, np.memmap)  # read from disk, not held in memory
    _equal(blocks.rows(range(len(blocks))), expected)
    one = folder / "sub" / "c.jsonl"
    _equal(data.corpus_blocks(str(one), tokenizer, block_len).rows(range(2)),
           data.first_blocks(data.token_blocks(data.load_texts(str(one)), tokenizer, block_len), 2))


def test_documents_start_with_bos_where_the_tokenizer_adds_one(tokenizer, folder):
    """Text follows the tokenizer's settings: BOS before every document where it adds one (none for
    SmolLM2's), EOS after it, the same in memory, from the cache and streamed."""
    import copy

    assert data.document_bos(tokenizer) is None
    with_bos = copy.deepcopy(tokenizer)
    with_bos.add_bos_token = True
    bos, eos = with_bos.bos_token_id, with_bos.eos_token_id
    assert data.document_bos(with_bos) == bos
    texts = data.load_texts(str(folder))
    memory = data.token_blocks(texts, with_bos, 64)
    ids = memory["input_ids"][memory["attention_mask"] == 1].tolist()
    assert ids[0] == bos and ids.count(bos) == len(texts)
    assert all(ids[i + 1] == bos for i, t in enumerate(ids[:-1]) if t == eos)  # each document after an EOS
    _equal(data.corpus_blocks(str(folder), with_bos, 64).rows(range(len(memory["input_ids"]))), memory)
    stream = large_corpus.BlockStream(str(folder), with_bos, 64)
    _equal(stream.batches(stream.take(2), 2)[0], data.first_blocks(memory, 2))
    plain = data.token_blocks(texts, tokenizer, 64)["input_ids"]
    assert bos not in plain[data.token_blocks(texts, tokenizer, 64)["attention_mask"] == 1].tolist()


def test_builtin_blocks_equal_the_in_memory_path(tokenizer):
    blocks = data.corpus_blocks("python-docs", tokenizer, 96)
    _equal(blocks.rows(range(len(blocks))), data.token_blocks(data.load_texts("python-docs"), tokenizer, 96))


def test_saved_dataset_equals_its_texts_and_needs_a_text_column(tokenizer, tmp_path):
    import datasets

    texts = data.load_texts("python-docs")[:7]
    datasets.Dataset.from_dict({"text": texts[:3] + [" "] + texts[3:], "id": list(range(8))}).save_to_disk(
        tmp_path / "saved")
    blocks = data.corpus_blocks(str(tmp_path / "saved"), tokenizer, 50)
    _equal(blocks.rows(range(len(blocks))), data.token_blocks(texts, tokenizer, 50))
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(tmp_path / "no-text")
    with pytest.raises(ValueError, match="no 'text' column.*body"):
        data.corpus_blocks(str(tmp_path / "no-text"), tokenizer, 50)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(tmp_path / "dict")
    with pytest.raises(ValueError, match="saved DatasetDict: pass one split's directory"):
        data.corpus_blocks(str(tmp_path / "dict"), tokenizer, 50)
    _equal(data.corpus_blocks(str(tmp_path / "dict" / "train"), tokenizer, 50).rows(range(3)),
           data.first_blocks(data.token_blocks(texts, tokenizer, 50), 3))
    stream = large_corpus.BlockStream(str(tmp_path / "saved"), tokenizer, 50)
    _equal(stream.batches(stream.take(4), 4)[0], blocks.rows(range(4)))  # streamed: same blocks, blank one skipped


def test_rows_in_any_order_and_a_last_block_too_short_to_score(tokenizer):
    stream = np.arange(10, dtype=np.int32)
    blocks = data.PackedBlocks(stream, 4, pad=-7)
    assert len(blocks) == 3  # [0..3], [4..7], [8, 9]
    rows = blocks.rows([2, 0])
    assert rows["input_ids"].tolist() == [[8, 9, -7, -7], [0, 1, 2, 3]]
    assert rows["labels"].tolist() == [[8, 9, -100, -100], [0, 1, 2, 3]]
    assert rows["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert len(data.PackedBlocks(np.arange(9, dtype=np.int32), 4, 0)) == 2  # a last block of 1 token is dropped
    assert data.PackedBlocks(stream, 4, 0).rows([])["input_ids"].shape == (0, 4)
    batches = data.LazyBatches(blocks, [1, 2, 0], 2)
    assert len(batches) == 2 and batches[1]["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert batches[-1]["input_ids"].tolist() == [[0, 1, 2, 3]]
    with pytest.raises(IndexError):
        batches[2]


def test_the_cache_follows_the_files_contents(tokenizer, folder):
    first = data.corpus_blocks(str(folder), tokenizer, 16)
    again = data.corpus_blocks(str(folder), tokenizer, 16)
    assert again.stream.filename == first.stream.filename  # tokenised and packed once
    (folder / "a.txt").write_text("a different first document " * 20)
    changed = data.corpus_blocks(str(folder), tokenizer, 16)
    assert changed.stream.filename != first.stream.filename
    _equal(changed.rows(range(len(changed))), data.token_blocks(data.load_texts(str(folder)), tokenizer, 16))


def test_several_tokenising_processes_give_the_same_blocks(tokenizer, tmp_path):
    rows = [{"text": f"document {i}: " + "word " * (i % 13)} for i in range(2 * large_corpus.WRITE_BATCH + 17)]
    (tmp_path / "many.jsonl").write_text("\n".join(map(json.dumps, rows)))
    one = data.corpus_blocks(str(tmp_path / "many.jsonl"), tokenizer, 32, workers=1)
    two = data.corpus_blocks(str(tmp_path / "many.jsonl"), tokenizer, 32, workers=2)
    assert len(one) == len(two) > 0
    _equal(one.rows(range(len(one))), two.rows(range(len(two))))
    _equal(one.rows(range(len(one))), data.token_blocks([r["text"] for r in rows], tokenizer, 32))


def test_bad_corpora_are_clear_errors(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        data.corpus_blocks(str(tmp_path / "missing"), tokenizer, 16)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="no .txt, .md, .jsonl file"):
        data.corpus_blocks(str(tmp_path / "nothing"), tokenizer, 16)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected a JSON object with a string 'text' field"):
        data.corpus_blocks(str(tmp_path / "bad.jsonl"), tokenizer, 16)
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not JSON"):
        data.corpus_blocks(str(tmp_path / "broken.jsonl"), tokenizer, 16)
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.corpus_blocks(str(tmp_path / "blank.txt"), tokenizer, 16)
    with pytest.raises(RunError, match="data_workers must be >= 0"):
        config_from({"data_workers": -1})


def test_stream_reads_the_packed_blocks_in_corpus_order(tokenizer, folder):
    packed = data.corpus_blocks(str(folder), tokenizer, 24)
    stream = large_corpus.BlockStream(str(folder), tokenizer, 24)
    first = stream.take(5)
    _equal(stream.batches(first, 2)[0], packed.rows([0, 1]))
    _equal(stream.batches(first, 2)[2], packed.rows([4]))
    with pytest.raises(ValueError, match="fewer than the 100000 a run reads first"):
        stream.take(100000)


def test_stream_batches_move_forward_restart_and_cycle(tokenizer, folder):
    """The batches an order names, read forward (an earlier index restarts the stream, past its end
    index i is batch i mod their count); no length (it was 2**62 before the end was read)."""
    packed = data.corpus_blocks(str(folder), tokenizer, 24)
    batches = large_corpus.StreamBatches(large_corpus.BlockStream(str(folder), tokenizer, 24), skip=3, batch_size=4)
    expected = data.LazyBatches(packed, list(range(3, len(packed))), 4)
    n = len(expected)
    with pytest.raises(TypeError):
        len(batches)
    got = list(batches.reading([2, 0, n + 1, 2 * n + 1, 2 * n + 3]))
    assert len(got) == 5
    for batch, i in zip(got, [2, 0, 1, 1, 3 % n]):
        _equal(batch, expected[i])
    for batch, i in zip(itertools.islice(batches, 2 * n + 1), list(range(n)) * 2 + [0]):  # by default: cycled
        _equal(batch, expected[i])
    empty = large_corpus.StreamBatches(large_corpus.BlockStream(str(folder), tokenizer, 24), skip=10 ** 6, batch_size=4)
    with pytest.raises(ValueError, match="no training block after the first 1000000"):
        next(iter(empty))


@pytest.mark.parametrize("workers", [0, 1])
def test_streamed_batches_through_the_loader_are_the_packed_ones_in_the_loops_order(tokenizer, folder, workers):
    """--streaming's batches through the training loop's DataLoader (0 workers, or the 1 it allows)
    are the packed corpus's batches `batches[((s·A + m)·W + r) mod n]` the loop indexed before, from a
    resumed step on, on each of 2 ranks; more workers are refused."""
    from types import SimpleNamespace

    from adept_ext.training.loader import batch_loader

    packed = data.corpus_blocks(str(folder), tokenizer, 24)
    expected = data.LazyBatches(packed, list(range(3, len(packed))), 2)
    batches = large_corpus.StreamBatches(large_corpus.BlockStream(str(folder), tokenizer, 24), skip=3, batch_size=2)
    cfg = SimpleNamespace(steps=len(expected), grad_accum=3, dataloader_num_workers=workers)
    for rank in range(2):
        got = list(batch_loader(batches, cfg, 2, torch.device("cpu"), 2, rank))
        want = [((s * 3 + m) * 2 + rank) % len(expected) for s in range(2, cfg.steps) for m in range(3)]
        assert len(got) == len(want)
        for batch, i in zip(got, want):
            _equal(batch, expected[i])
    with pytest.raises(RunError, match="--dataloader-num-workers 0 or 1, not 2"):
        config_from({"streaming": True, "dataloader_num_workers": 2})


def test_corpora_split_equals_the_in_memory_split(tokenizer, folder):
    cfg = RunConfig(general="bbc-news", domain=str(folder), max_length=32, batch_size=3, eval_blocks=5, probe_blocks=4,
                    seed=3)
    corpora = Corpora(cfg, tokenizer)
    train, held = data.split_blocks(data.token_blocks(data.load_texts(str(folder)), tokenizer, 32), 0.1, seed=3)
    expected_train = data.batches(train, 3)
    assert len(corpora.domain_train) == len(expected_train)
    for got, want in zip(corpora.domain_train, expected_train):
        _equal(got, want)
    for got, want in zip(corpora.domain_eval, data.batches(data.first_blocks(held, 5), 3)):
        _equal(got, want)
    for got, want in zip(corpora.domain_probe, data.batches(data.first_blocks(train, 4), 3)):
        _equal(got, want)


def test_streamed_corpora_hold_out_the_first_blocks(tokenizer, folder):
    cfg = RunConfig(general="python-docs", domain=str(folder), max_length=32, batch_size=2, eval_blocks=3,
                    probe_blocks=2, diagnosis_queries=4, streaming=True)
    corpora = Corpora(cfg, tokenizer)
    packed = data.corpus_blocks(str(folder), tokenizer, 32)
    general = data.corpus_blocks("python-docs", tokenizer, 32)
    _equal(corpora.domain_eval[1], packed.rows([2]))
    _equal(corpora.domain_probe[0], packed.rows([3, 4]))
    _equal(next(iter(corpora.domain_train)), packed.rows([3, 4]))  # training starts after the held-out blocks
    _equal(corpora.general_probe[0], general.rows([3, 4]))
    assert sum(b["input_ids"].shape[0] for b in corpora.general_context) == 4


def _corpora_worker(rank, world, init_file, folder, result_file):
    import torch.distributed as dist

    from adept_ext.models import load_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        corpora = Corpora(RunConfig(general="python-docs", domain=folder, max_length=16, batch_size=2, eval_blocks=3,
                                    probe_blocks=2), load_model("smollm2-135m")[1])
        torch.save({"eval": corpora.domain_eval, "train": list(itertools.islice(corpora.domain_train, 3))},
                   f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_see_the_same_blocks_from_one_cache(tmp_path, folder, monkeypatch):
    """Under 2 gloo processes with a fresh cache: rank 0 tokenises and packs first, rank 1 then
    reads that cache; both get the same held-out and training batches."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # read by the spawned processes
    mp.spawn(_corpora_worker, args=(2, str(tmp_path / "init"), str(folder), str(tmp_path / "r")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r.{r}") for r in (0, 1))
    for a, b in zip(r0["eval"] + r0["train"], r1["eval"] + r1["train"]):
        _equal(a, b)
    assert len(list((tmp_path / "cache").glob("**/adept-ext-stream-*.int32"))) == 1
