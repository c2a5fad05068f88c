"""Packing without cross-document attention (`--packing`, docs/data.md): whole documents or examples
placed into rows of `max_length` tokens by best-fit decreasing, each keeping its own positions.

- `DocumentRows`: a text corpus as one row per document (its ids and EOS, the tokens of the wrapped
  stream cut at document ends instead of every `max_length`), a document longer than a row split into
  pieces of `max_length` (the last one shorter), and only then; read on access from the stream (memory-
  mapped for a large corpus, `large_corpus`), so the held-out split and probes stay one padded row each.
- `best_fit_decreasing`: the bins of row lengths (TRL's `packing_strategy="bfd"`).
- `PackedRows`: the rows of any block source (`rows`/`len`: DocumentRows, instruction TensorBlocks, a
  BlockSet of them) packed into {input_ids, labels, position_ids} rows with no attention_mask: position
  ids restart at 0 at each document and at the padding tail, and each document's first label is -100
  (the model shifts labels, so no token is trained to predict the next document). This is Hugging
  Face's `DataCollatorWithFlattening` contract: given position ids and no attention mask, transformers'
  masking_utils (`find_packed_sequence_indices`) confines sdpa's and eager attention to each document
  (a block-diagonal causal mask); flash attention's variable-length path reads the same ids in one row
  only, so the loss flattens a micro-batch of packed rows for it (`models.packed_attention.packed_layout`).
"""
from bisect import bisect_left, insort
from heapq import heappop, heappush
from typing import Dict, List, Sequence

import numpy as np
import torch

from ..errors import InputError
from .blocks import BlockSet, pack_stream, shuffled_view, stream_rows

LENGTH_CHUNK = 4096  # rows read per call when the lengths of a source must be read from its rows


class DocumentRows:
    """One right-padded row of at most `block_len` tokens per document piece of a token stream whose
    document i is stream[ends[i-1], ends[i]) (0 for ends[-1]): piece k of a document of n tokens holds
    its tokens [k·L, min(n, (k+1)·L)); a piece with fewer than 2 tokens is dropped (nothing to score).
    `rows` gives input_ids, attention_mask and labels (= ids, -100 at padding) like `PackedBlocks`."""

    def __init__(self, stream: np.ndarray, ends: np.ndarray, block_len: int, pad: int):
        if block_len < 2:
            raise InputError(f"block_len must be >= 2, got {block_len}")
        self.stream, self.block_len, self.pad = stream, block_len, pad
        ends = np.asarray(ends, dtype=np.int64)
        starts = np.concatenate([np.zeros(1, np.int64), ends])[:-1]
        sizes = ends - starts
        pieces = -(-sizes // block_len)
        doc = np.repeat(np.arange(len(ends)), pieces)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        lengths = np.minimum(block_len, sizes[doc] - k * block_len)
        keep = lengths >= 2
        self.starts, self.lengths = starts[doc][keep] + k[keep] * block_len, lengths[keep]

    @classmethod
    def of(cls, documents: Sequence[Sequence[int]], eos, block_len: int, pad: int) -> "DocumentRows":
        """From token id lists held in memory, each followed by `eos` (when not None)."""
        sep = 0 if eos is None else 1
        return cls(pack_stream(documents, eos), np.cumsum([len(doc) + sep for doc in documents], dtype=np.int64),
                   block_len, pad)

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        """input_ids, attention_mask and labels [len(indices), block_len] of those pieces."""
        indices = np.asarray(indices, dtype=np.int64)
        return stream_rows(self.stream, self.starts[indices], self.lengths[indices], self.block_len, self.pad)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bins (lists of item indices) of total length ≤ `capacity`: items in decreasing length (ties in
    index order) each go to the open bin with the least room that still fits it (ties: the oldest
    bin), else to a new bin. Deterministic; O(n log n) with the bins kept by their remaining room
    (at most capacity + 1 distinct values). An item of length 0 is placed nowhere; InputError for
    one longer than `capacity` (split it first)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        i = int(lengths.argmax())
        raise InputError(f"item {i} has {lengths[i]} tokens, more than a row of {capacity}: split it first")
    bins: List[List[int]] = []
    rooms: List[int] = []  # sorted distinct remaining room of the open bins
    by_room: Dict[int, List[int]] = {}  # room -> heap of the open bins with exactly that room
    for i in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[i])
        if need == 0:
            break
        k = bisect_left(rooms, need)
        if k < len(rooms):
            room = rooms[k]
            b = heappop(by_room[room])
            if not by_room[room]:
                del rooms[k], by_room[room]
            bins[b].append(i)
        else:
            b, room = len(bins), capacity
            bins.append([i])
        left = room - need
        if left:
            if left not in by_room:
                insort(rooms, left)
                by_room[left] = []
            heappush(by_room[left], b)
    return bins


def row_lengths(source) -> np.ndarray:
    """Tokens of each row of `source` (its attention mask's sum): read from `DocumentRows` and through
    a `BlockSet` without reading rows, else from its rows `LENGTH_CHUNK` at a time."""
    if isinstance(source, BlockSet):
        return row_lengths(source.source)[source.indices]
    if isinstance(source, DocumentRows):
        return source.lengths
    return np.concatenate([source.rows(np.arange(i, min(i + LENGTH_CHUNK, len(source))))["attention_mask"]
                           .sum(1).numpy() for i in range(0, len(source), LENGTH_CHUNK)] or [np.zeros(0, np.int64)])


class PackedRows:
    """The rows of `source` (right-padded rows of at most `block_len` tokens with attention_mask and
    labels) packed by `best_fit_decreasing` into rows of `block_len` (see the module docstring): row i
    holds the tokens of bin i's source rows one after another, then a padding tail (`pad`, labels
    -100); position_ids restart at 0 at each source row and at the tail; each source row's first
    label is -100. Built on access, like every block source."""

    def __init__(self, source, block_len: int, pad: int):
        self.source, self.block_len, self.pad = source, block_len, pad
        self.lengths = row_lengths(source)
        self.bins = best_fit_decreasing(self.lengths, block_len)
        if not self.bins:
            raise InputError("nothing to pack: every row is empty")

    def __len__(self) -> int:
        return len(self.bins)

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        """input_ids, labels and position_ids [len(indices), block_len] of those packed rows."""
        bins = [self.bins[i] for i in np.asarray(indices, dtype=np.int64).tolist()]
        got = self.source.rows(np.asarray([m for b in bins for m in b], dtype=np.int64))
        width = self.block_len
        input_ids = torch.full((len(bins), width), self.pad, dtype=torch.long)
        labels = torch.full((len(bins), width), -100, dtype=torch.long)
        position_ids = torch.zeros(len(bins), width, dtype=torch.long)
        r = 0
        for row, members in enumerate(bins):
            at = 0
            for _ in members:
                kept = got["attention_mask"][r] == 1
                n = int(kept.sum())
                input_ids[row, at:at + n] = got["input_ids"][r][kept]
                labels[row, at + 1:at + n] = got["labels"][r][kept][1:]
                position_ids[row, at:at + n] = torch.arange(n)
                at, r = at + n, r + 1
            position_ids[row, at:] = torch.arange(width - at)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def packed_view(rows, block_len: int, pad: int, seed: int) -> BlockSet:
    """The training blocks of `rows` under `--packing`: `PackedRows` of them in a seeded shuffle
    (best-fit decreasing orders its rows by length; training should not)."""
    return shuffled_view(PackedRows(rows, block_len, pad), seed)
