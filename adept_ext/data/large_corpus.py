"""User corpora of any size through Hugging Face `datasets`: nothing holds the whole corpus in memory.

A source is a text or Markdown file (one document), a JSONL file (a "text" field per line), a
folder of those (recursively, sorted by path), a directory written by `Dataset.save_to_disk`
(a "text" column) or, for streaming, a built-in corpus name. Two ways to read it:

- `packed_blocks` (default): the documents become an Arrow dataset on disk (`from_generator`, or
  the saved one), are tokenised by `map(batched=True, num_proc=workers)` — cached by `datasets`
  under its cache directory, keyed by the corpus files (path, size, mtime) and the tokenizer —
  and are packed once into one int32 token stream file beside that cache (documents joined by
  EOS), memory-mapped. `blocks.PackedBlocks` cuts it into blocks on access, so the runner's
  shuffled split and batches read only the blocks they use. The blocks equal `blocks.token_blocks`
  on the same documents: the same run gives the same numbers whether a corpus is small or large.
- `BlockStream` (`--streaming`): an `IterableDataset` tokenised on the fly, packed into blocks
  in corpus order; no cache at all, and only the part of the corpus a run consumes is read.

Under torchrun every rank reads the same blocks in the same order and keeps its own batches
(the trainer's batch i goes to rank i mod W), so the data are sharded by rank without a
sharding scheme of their own; rank 0 builds the caches first (`parallel.rank_zero_first`).
"""
import itertools
import os
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..errors import InputError
from .blocks import PackedBlocks, block_rows, document_bos, document_ids, pack_stream, pad_id
from .packing import DocumentRows
from .sources import BUILTIN_CORPORA, corpus_files, iter_documents, load_texts

WRITE_BATCH = 8000  # documents per tokenizer call and per Arrow record batch


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _documents(files: Sequence[str], stamps: Sequence[str]) -> Iterator[Dict[str, str]]:
    """{"text": document} for every non-blank document of `files` in order (`stamps` only key the cache)."""
    for path in files:
        for text in iter_documents(Path(path)):
            if text.strip():
                yield {"text": text}


def _has_text(row) -> bool:
    return bool(row["text"].strip())


def _builtin_documents(name: str) -> Iterator[Dict[str, str]]:
    for text in load_texts(name):
        yield {"text": text}


def _generator_kwargs(source: str) -> Dict:
    files = corpus_files(source)
    return {"files": [str(p.resolve()) for p in files],
            "stamps": [f"{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]}


def load_documents(source: str, streaming: bool = False):
    """The corpus as a `datasets.Dataset` (on disk) or `IterableDataset` (streaming) of "text"."""
    import datasets

    path = Path(source)
    if (path / "dataset_dict.json").is_file():
        raise InputError(f"corpus {source!r} is a saved DatasetDict: pass one split's directory "
                         f"(e.g. {path / 'train'})")
    if is_saved_dataset(path):
        dataset = datasets.load_from_disk(str(path))
        if "text" not in dataset.column_names:
            raise InputError(f"corpus {source!r}: the saved dataset has no 'text' column "
                             f"(columns: {', '.join(dataset.column_names)})")
        dataset = dataset.select_columns(["text"])
        return (dataset.to_iterable_dataset() if streaming else dataset).filter(_has_text)
    kind = datasets.IterableDataset if streaming else datasets.Dataset
    features = datasets.Features({"text": datasets.Value("string")})
    if source in BUILTIN_CORPORA:
        return kind.from_generator(_builtin_documents, features=features, gen_kwargs={"name": source})
    kwargs = _generator_kwargs(source)
    if next(_documents(**kwargs), None) is None:  # datasets cannot build an empty dataset from a generator
        raise InputError(f"corpus {source!r} holds no text")
    try:
        return kind.from_generator(_documents, features=features, gen_kwargs=kwargs)
    except datasets.exceptions.DatasetGenerationError as e:  # a bad document: say which, not where datasets was
        raise e.__cause__ if isinstance(e.__cause__, (ValueError, OSError)) else e


class _Tokenize:
    """The batched `map` function: {"text": [...]} -> {"input_ids": [...]}, `blocks.document_ids`
    (the BOS is part of its state, so of the cache's fingerprint)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.bos = tokenizer, document_bos(tokenizer)

    def __call__(self, batch):
        return {"input_ids": document_ids(self.tokenizer, batch["text"], self.bos)}


def tokenize(dataset, tokenizer, workers: int = 1):
    """`dataset` with one int32 "input_ids" list per document, by `map` (cached on disk when
    `dataset` is; `workers` processes when it has at least that many batches of documents)."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        return dataset.map(_Tokenize(tokenizer), batched=True, batch_size=WRITE_BATCH, remove_columns=["text"])
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    workers = max(1, min(workers, len(dataset) // WRITE_BATCH))
    return dataset.map(_Tokenize(tokenizer), batched=True, batch_size=WRITE_BATCH, remove_columns=["text"],
                       features=features, num_proc=workers if workers > 1 else None, desc="tokenising")


def _write_stream(tokens, eos: Optional[int], path: Path):
    """Concatenate every document's ids (+ EOS) of the tokenised Arrow dataset into `path` (int32),
    one record batch at a time, atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        for batch in tokens.data.to_batches(max_chunksize=WRITE_BATCH):
            column = batch.column("input_ids")
            offsets = column.offsets.to_numpy()
            values = column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]].astype(np.int32, copy=False)
            if eos is None:
                values.tofile(out)
                continue
            lengths = np.diff(offsets)
            packed = np.full(len(values) + len(lengths), eos, dtype=np.int32)
            keep = np.ones(len(packed), dtype=bool)
            keep[np.cumsum(lengths + 1) - 1] = False  # each document's EOS slot
            packed[keep] = values
            packed.tofile(out)
    os.replace(tmp, path)


def _write_ends(tokens, eos: Optional[int], path: Path):
    """Each document's end in the stream `_write_stream` writes (int64, its EOS included), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        end = 0
        for batch in tokens.data.to_batches(max_chunksize=WRITE_BATCH):
            sizes = np.diff(batch.column("input_ids").offsets.to_numpy()) + (eos is not None)
            ends = end + np.cumsum(sizes, dtype=np.int64)
            ends.tofile(out)
            end = int(ends[-1]) if len(ends) else end
    os.replace(tmp, path)


def packed_blocks(source: str, tokenizer, block_len: int, workers: int = 1, documents: bool = False):
    """The corpus `source` as blocks of a memory-mapped token stream (see the module docstring);
    `documents`: as `packing.DocumentRows` of it, one row per document (`--packing`), the documents'
    ends in a second file beside the stream."""
    tokens = tokenize(load_documents(source), tokenizer, workers)
    if not tokens.cache_files:
        raise InputError(f"corpus {source!r}: the tokenised dataset has no cache file to pack beside")
    eos = tokenizer.eos_token_id
    path = Path(tokens.cache_files[0]["filename"]).parent / f"adept-ext-stream-{tokens._fingerprint}-eos{eos}.int32"
    if not path.exists():
        _write_stream(tokens, eos, path)
    stream = np.memmap(path, dtype=np.int32, mode="r") if path.stat().st_size else np.zeros(0, np.int32)
    if documents:
        ends_path = path.with_suffix(".ends.int64")
        if not ends_path.exists():
            _write_ends(tokens, eos, ends_path)
        ends = np.memmap(ends_path, dtype=np.int64, mode="r") if ends_path.stat().st_size else np.zeros(0, np.int64)
        blocks = DocumentRows(stream, ends, block_len, pad_id(tokenizer))
    else:
        blocks = PackedBlocks(stream, block_len, pad_id(tokenizer))
    if not len(blocks):
        raise InputError(f"corpus {source!r} holds no text with a token to score")
    return blocks


class BlockStream:
    """Blocks of `block_len` tokens packed on the fly from a streamed corpus, in corpus order:
    `take(n)` the first n blocks (held-out, probe), then `StreamBatches` the rest as batches read
    as the run consumes them."""

    def __init__(self, source: str, tokenizer, block_len: int):
        if block_len < 2:
            raise InputError(f"block_len must be >= 2, got {block_len}")
        self.source, self.tokenizer, self.block_len = source, tokenizer, block_len
        self.pad = pad_id(tokenizer)

    def __iter__(self) -> Iterator[np.ndarray]:
        """Blocks (int32 arrays of at most block_len tokens; only the last may be shorter, never < 2)."""
        eos = self.tokenizer.eos_token_id
        buffer = np.zeros(0, dtype=np.int32)
        for row in tokenize(load_documents(self.source, streaming=True), self.tokenizer):
            buffer = np.concatenate([buffer, np.asarray(row["input_ids"], dtype=np.int32)]
                                    + ([np.asarray([eos], dtype=np.int32)] if eos is not None else []))
            whole = len(buffer) // self.block_len * self.block_len
            yield from buffer[:whole].reshape(-1, self.block_len)
            buffer = buffer[whole:]
        if len(buffer) >= 2:
            yield buffer

    def take(self, n: int) -> List[np.ndarray]:
        """The first n blocks; ValueError when the corpus has fewer."""
        blocks = [block for _, block in zip(range(n), self)]
        if len(blocks) < n:
            raise InputError(f"corpus {self.source!r}: {len(blocks)} blocks of {self.block_len} tokens, "
                             f"fewer than the {n} a run reads first")
        return blocks

    def batches(self, blocks: Sequence[np.ndarray], batch_size: int) -> List[Dict[str, torch.Tensor]]:
        """`blocks` (from `take`) as consecutive batches."""
        return [block_rows(blocks[i:i + batch_size], self.pad, self.block_len)
                for i in range(0, len(blocks), batch_size)]


class StreamBatches(IterableDataset):
    """Training batches of a `BlockStream` after its first `skip` blocks (batch i: the stream's
    blocks skip + i·B … skip + (i+1)·B - 1), as an `IterableDataset` that yields the batches
    `order` names (`reading`; every batch, cycled without end, by default), reading the stream
    forward once: the batches before the first one named (a resumed run's) are passed over, not
    built, an earlier index than the last restarts the stream, and once its end has been read,
    index i is batch i mod the number of batches (the corpus is cycled like an in-memory one).
    It has no length: that of the stream is unknown until it has been read."""

    def __init__(self, stream: BlockStream, skip: int, batch_size: int, order: Iterable[int] = None):
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        self.stream, self.skip, self.batch_size = stream, skip, batch_size
        self.order = itertools.count() if order is None else order

    def reading(self, order: Iterable[int]) -> "StreamBatches":
        """The same batches yielding those of `order` (a range: picklable for a loader worker)."""
        return StreamBatches(self.stream, self.skip, self.batch_size, order)

    def _chunks(self) -> Iterator[List[np.ndarray]]:
        blocks = itertools.islice(self.stream, self.skip, None)
        while chunk := list(itertools.islice(blocks, self.batch_size)):
            yield chunk

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        count, chunks, position = None, self._chunks(), 0  # position: the index of the next chunk
        for i in self.order:
            i = i if count is None else i % count
            if i < position:
                chunks, position = self._chunks(), 0
            while position <= i:
                chunk = next(chunks, None)
                if chunk is None:
                    if position == 0:
                        raise InputError(f"corpus {self.stream.source!r}: no training block after the first "
                                         f"{self.skip}")
                    count, i = position, i % position
                    chunks, position = self._chunks(), 0
                    continue
                position += 1
            yield block_rows(chunk, self.stream.pad, self.stream.block_len)


def corpus_blocks(source: str, tokenizer, block_len: int = 128, workers: int = 1, documents: bool = False):
    """A corpus as `PackedBlocks`: a built-in corpus tokenised in memory; a file, folder or saved
    dataset through `packed_blocks` (Hugging Face datasets, cached on disk, memory-mapped). The
    blocks are those of `token_blocks(load_texts(source), ...)` either way. `documents`
    (`--packing`): as `packing.DocumentRows`, one row per document piece, the same tokens."""
    if source in BUILTIN_CORPORA:
        ids = document_ids(tokenizer, load_texts(source), document_bos(tokenizer))
        if documents:
            return DocumentRows.of(ids, tokenizer.eos_token_id, block_len, pad_id(tokenizer))
        return PackedBlocks(pack_stream(ids, tokenizer.eos_token_id), block_len, pad_id(tokenizer))
    return packed_blocks(source, tokenizer, block_len, workers, documents)
