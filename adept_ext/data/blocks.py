"""Token blocks: documents tokenised and packed into fixed-length blocks with labels, views of
them (subsets, concatenations, the seeded train / held-out split) and batches."""
import random
from fractions import Fraction
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch

from ..errors import InputError

def pad_rows(rows: Sequence[Sequence[int]], pad: int, width: int = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [n, width] ids (width: the longest row by default) and their attention mask."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def block_rows(rows: Sequence[Sequence[int]], pad: int, width: int) -> Dict[str, torch.Tensor]:
    """Blocks of token rows (each at most `width`): input_ids, attention_mask and labels (the ids
    with -100 at padding; the model shifts them)."""
    input_ids, attention_mask = pad_rows(rows, pad, width)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def check_labels(batch: Dict[str, torch.Tensor], vocab_size: int, ignore_index: int = -100):
    """InputError (a ValueError) naming the first label of `batch` that is neither in
    [0, vocab_size) nor `ignore_index`. Read on the host (a batch as this package builds it), once
    before the batch goes to the device: the fused loss does not read its targets back from a GPU."""
    labels = batch["labels"].cpu().numpy()
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"labels{list(where)} = {labels[where]} is outside the model's vocabulary [0, {vocab_size}) "
                         f"and is not {ignore_index} (a position not scored)")


def pad_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS token; ValueError when it has neither."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise InputError("the tokenizer has neither a pad nor an EOS token")
    return pad


def document_bos(tokenizer):
    """The BOS token id the tokenizer puts before a text when it adds special tokens (Llama's,
    Gemma's, Mistral's), else None (SmolLM2's, Qwen's add none): what starts each document or
    example, as the tokenizer's own settings say (docs/data.md, "BOS and EOS")."""
    bos = tokenizer.bos_token_id
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    return bos if bos is not None and with_special[:1] == [bos] and plain[:1] != [bos] else None


def document_ids(tokenizer, texts: Sequence[str], bos=None) -> List[List[int]]:
    """Each text's token ids without special tokens, `bos` (`document_bos(tokenizer)`: the
    tokenizer's BOS where it adds one) first; EOS follows when documents are joined (`pack_stream`)."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return ids if bos is None else [[bos, *doc] for doc in ids]


def pack_stream(docs: Iterable[Sequence[int]], eos) -> np.ndarray:
    """One int32 token stream: the documents' ids, each followed by `eos` (when not None)."""
    sep = [] if eos is None else [eos]
    return np.fromiter((t for doc in docs for t in (*doc, *sep)), dtype=np.int32)


def stream_rows(stream: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int,
                pad: int) -> Dict[str, torch.Tensor]:
    """Rows stream[starts[i], starts[i] + lengths[i]) right-padded to `width` with `pad`: input_ids,
    attention_mask and labels (the ids, -100 at padding) [len(starts), width]; only those tokens are read."""
    offsets = np.arange(width)
    inside = offsets < np.asarray(lengths)[:, None]
    ids = np.where(inside, stream[np.minimum(np.asarray(starts)[:, None] + offsets, len(stream) - 1)], pad)
    input_ids = torch.from_numpy(ids.astype(np.int64))
    attention_mask = torch.from_numpy(inside.astype(np.int64))
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


class PackedBlocks:
    """Blocks of `block_len` tokens cut from one token stream (documents joined by EOS): block i
    is stream[i·L, (i+1)·L), the last one right-padded, and dropped when it has fewer than 2
    tokens (nothing to score). Rows are built on access, so a stream memory-mapped from disk
    (`large_corpus`) is never read whole. labels = input ids with -100 at padding (the model
    shifts them)."""

    def __init__(self, stream: np.ndarray, block_len: int, pad: int):
        if block_len < 2:
            raise InputError(f"block_len must be >= 2, got {block_len}")
        self.stream, self.block_len, self.pad = stream, block_len, pad
        n = -(-len(stream) // block_len)
        self.num_blocks = n - 1 if n and len(stream) - (n - 1) * block_len < 2 else n

    def __len__(self) -> int:
        return self.num_blocks

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        """input_ids, attention_mask and labels [len(indices), block_len] of those blocks."""
        starts = np.asarray(indices, dtype=np.int64) * self.block_len
        return stream_rows(self.stream, starts, np.minimum(len(self.stream) - starts, self.block_len), self.block_len,
                           self.pad)

    def batches(self, indices: Sequence[int], batch_size: int) -> List[Dict[str, torch.Tensor]]:
        """The blocks `indices` as consecutive batches of `batch_size` (built now: for small sets)."""
        return list(LazyBatches(self, indices, batch_size))


class LazyBatches(Sequence):
    """Batch i = blocks indices[i·B, (i+1)·B) of `blocks`, read when it is asked for: the
    training set of a corpus of any size, indexable like a list of batches."""

    def __init__(self, blocks: PackedBlocks, indices: Sequence[int], batch_size: int):
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        self.blocks, self.indices, self.batch_size = blocks, indices, batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"batch {i} of {len(self)}")
        i %= len(self)
        return self.blocks.rows(self.indices[i * self.batch_size:(i + 1) * self.batch_size])


class TensorBlocks:
    """Blocks held as tensors ({input_ids, attention_mask, labels} [n, block_len]: instruction
    examples, the general half of BBC News) behind the `rows` interface of PackedBlocks; examples'
    blocks (`truncation.ExampleBlocks`) keep their `truncation` counts, other blocks None."""

    def __init__(self, blocks: Dict[str, torch.Tensor]):
        self.blocks = blocks
        self.block_len = int(blocks["input_ids"].shape[1])
        self.truncation = getattr(blocks, "truncation", None)

    def __len__(self) -> int:
        return int(self.blocks["input_ids"].shape[0])

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return {k: v[index] for k, v in self.blocks.items()}


class ConcatBlocks:
    """The blocks of `parts` (each with `len` and `rows`, all of one block length) one after
    another: replay's mixture of a task's blocks and its buffer, read on access. A tag column
    (`TaggedBlocks`, one value per block) that some parts lack is -1 on their blocks (general
    blocks mixed into replay's tagged rows); every other column must be in every part."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(part) for part in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        owner = np.searchsorted(self.starts, indices, side="right") - 1
        pieces = [(np.nonzero(owner == j)[0], self.parts[j].rows(indices[owner == j] - self.starts[j]))
                  for j in np.unique(owner)] or [(indices, self.parts[0].rows(indices))]
        columns = {k: v for _, got in pieces for k, v in got.items()}
        out = {k: (v.new_full((len(indices),), -1) if v.dim() == 1 else v.new_empty((len(indices), *v.shape[1:])))
               for k, v in columns.items()}
        for where, got in pieces:
            lacking = [k for k in columns if k not in got and columns[k].dim() > 1]
            if lacking:
                raise InputError(f"blocks without the column(s) {lacking} mixed with blocks that have them")
            for k, v in got.items():
                out[k][torch.from_numpy(where)] = v
        return out


class TaggedBlocks:
    """The blocks of `source` with one more column `name` holding `values[i]` for block i (an
    int64 [n] array): replay's slot numbers (-1 for a task's own rows, the buffer row's slot for
    replayed ones), so a loss can tell which rows of a batch were replayed. A view."""

    def __init__(self, source, name: str, values: np.ndarray):
        values = np.asarray(values, dtype=np.int64)
        if len(values) != len(source):
            raise InputError(f"{len(values)} values of {name!r} for {len(source)} blocks")
        self.source, self.name, self.values = source, name, values

    def __len__(self) -> int:
        return len(self.source)

    def rows(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        return {**self.source.rows(indices), self.name: torch.from_numpy(self.values[indices])}


class BlockSet:
    """Blocks `indices` (in that order) of `source` — PackedBlocks, TensorBlocks, ConcatBlocks or
    another BlockSet — read when they are asked for: a task's split of a memory-mapped corpus is
    never read whole."""

    def __init__(self, source, indices: Sequence[int] = None):
        self.source = source
        self.indices = np.arange(len(source)) if indices is None else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def rows(self, positions: Sequence[int]) -> Dict[str, torch.Tensor]:
        return self.source.rows(self.indices[np.asarray(positions, dtype=np.int64)])

    def first(self, n: int) -> "BlockSet":
        """The first `n` blocks (all of them when there are fewer)."""
        return BlockSet(self.source, self.indices[:n])

    def after(self, n: int) -> "BlockSet":
        """The blocks after the first `n` (what `first(n)` leaves)."""
        return BlockSet(self.source, self.indices[n:])

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every block as tensors (for small sets: evaluation, probes)."""
        return self.rows(np.arange(len(self)))

    def batches(self, batch_size: int) -> "LazyBatches":
        """Consecutive batches of `batch_size` blocks, each read when it is asked for."""
        return LazyBatches(self, np.arange(len(self)), batch_size)


def interleave_blocks(parts: Sequence[BlockSet], weights: Sequence[float], seed: int,
                      repeat: bool = True) -> BlockSet:
    """The blocks of several sources interleaved at random with probabilities ∝ `weights`
    (LLaMA-Factory's `interleave_probs`, `datasets.interleave_datasets` with
    stopping_strategy="all_exhausted"): each position draws a source j with probability
    w_j / Σw and takes its next block (each source in its own order, started again when it runs
    out), until every source has given every block once — nothing is dropped, a light source is
    repeated. `repeat=False` (held-out blocks): every block once, a source that ran out skipped.
    One source: itself. A view: nothing is copied."""
    if len(parts) != len(weights) or not parts:
        raise InputError(f"{len(weights)} weights for {len(parts)} sources: give one weight per source")
    if len(parts) == 1:
        return parts[0]
    p = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    sizes = np.asarray([len(part) for part in parts], dtype=np.int64)
    if not sizes.all():
        raise InputError("a weighted source holds no block")
    rng, chosen, taken = np.random.default_rng(seed), [], np.zeros(len(parts), dtype=np.int64)
    while (taken < sizes).any():  # draws of about max_j(n_j / p_j) positions, in chunks
        draw = rng.choice(len(parts), size=max(16, int(max(sizes / p)) - int(taken.sum())), p=p)
        seen = np.zeros(len(parts), dtype=np.int64)
        for k, j in enumerate(draw):  # cut the chunk where the last source gives its last block
            seen[j] += 1
            if ((taken + seen) >= sizes).all():
                draw = draw[:k + 1]
                break
        chosen.append(draw)
        taken += np.bincount(draw, minlength=len(parts))
    source = np.concatenate(chosen)
    nth = np.zeros_like(source)  # the how-many-th block of its source each position takes
    for j in range(len(parts)):
        nth[source == j] = np.arange(int((source == j).sum()))
    if not repeat:
        source, nth = source[nth < sizes[source]], nth[nth < sizes[source]]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return BlockSet(ConcatBlocks(parts), starts[source] + nth % sizes[source])


def mix_blocks(main: BlockSet, extra: BlockSet, fraction: float, seed: int) -> BlockSet:
    """`main`'s blocks in order with a `fraction` f of blocks from `extra` spread evenly among
    them: block k of the result comes from `extra` when ⌊(k+1)·f⌋ > ⌊k·f⌋ (so any n consecutive
    blocks hold ⌊n·f⌋ or ⌈n·f⌉ of them), drawn in one seeded shuffle of `extra` (cycled when it
    is shorter); every block of `main` appears exactly once. General-data mixing against
    forgetting (`--mix-general`, docs/methods.md §5). A view: nothing is copied."""
    if not 0 <= fraction < 1:
        raise InputError(f"the mixed fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return main
    if len(extra) == 0:
        raise InputError("no general blocks are left to mix in: every training block of the general corpus is a "
                         "probe block (lower --probe-blocks or use a larger corpus)")
    ratio = Fraction(fraction).limit_denominator(10**6)
    p, q, n = ratio.numerator, ratio.denominator, len(main)
    total = n + (n * p) // (q - p)  # the smallest length with n blocks of `main`: total - ⌊total·f⌋ = n
    while total - (total * p) // q < n:
        total += 1
    k = np.arange(total, dtype=np.int64)
    before = k * p // q  # blocks of `extra` among the first k
    from_extra = (k + 1) * p // q > before
    order = np.empty(total, dtype=np.int64)
    order[~from_extra] = np.arange(n)
    order[from_extra] = n + np.random.default_rng(seed).permutation(len(extra))[before[from_extra] % len(extra)]
    return BlockSet(ConcatBlocks([main, extra]), order)


def split_views(blocks, seed: int, what: str) -> Tuple[BlockSet, BlockSet]:
    """(train, held-out) views of `blocks` (PackedBlocks or TensorBlocks): the seeded 10 % split
    of `split_indices`. InputError naming `what` (e.g. "the general corpus") when it has fewer
    than two blocks, so nothing could be held out."""
    if len(blocks) < 2:
        raise InputError(f"{what} is shorter than two blocks of {blocks.block_len} tokens: nothing to hold out")
    train, held = split_indices(len(blocks), 0.1, seed)
    return BlockSet(blocks, train), BlockSet(blocks, held)


def token_blocks(texts: Sequence[str], tokenizer, block_len: int = 128, pack: bool = True) -> Dict[str, torch.Tensor]:
    """Tokenise and cut into blocks of `block_len` tokens.

    Each document starts with the tokenizer's BOS where it adds one (`document_bos`).
    pack=True: documents are joined with the EOS token and cut into consecutive blocks (only the
    last block is padded; `PackedBlocks`). pack=False: each document is cut on its own and its
    last block padded. Returns input_ids, attention_mask and labels [n_blocks, block_len]; labels
    are the input ids with -100 at padding (the model shifts them). Raises ValueError when no
    block has a token to score.
    """
    if block_len < 2:
        raise InputError(f"block_len must be >= 2, got {block_len}")
    pad = pad_id(tokenizer)
    ids = document_ids(tokenizer, texts, document_bos(tokenizer))
    if pack:
        blocks = PackedBlocks(pack_stream(ids, tokenizer.eos_token_id), block_len, pad)
        if not len(blocks):
            raise InputError("the texts yield no block with a token to score (empty or too short)")
        return blocks.rows(range(len(blocks)))
    pieces = [doc[i:i + block_len] for doc in ids for i in range(0, len(doc), block_len)]
    pieces = [p for p in pieces if len(p) >= 2]  # a block needs one target to score
    if not pieces:
        raise InputError("the texts yield no block with a token to score (empty or too short)")
    return block_rows(pieces, pad, block_len)


def shuffled_view(blocks, seed: int) -> BlockSet:
    """Every block of `blocks`, in the order of `seed`'s shuffle (`split_indices`' shuffle, nothing
    held out: the training blocks of a corpus whose held-out blocks come from elsewhere)."""
    order = list(range(len(blocks)))
    random.Random(seed).shuffle(order)
    return BlockSet(blocks, order)


def split_indices(n: int, heldout_fraction: float = 0.1, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Deterministic shuffle of range(n) (by `seed`), then (train, held-out) block indices with at
    least one in each."""
    if n < 2:
        raise InputError(f"need at least 2 blocks to hold some out, got {n}")
    if not 0 < heldout_fraction < 1:
        raise InputError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(n - 1, max(1, round(n * heldout_fraction)))
    order = np.asarray(order, dtype=np.int64)
    return order[k:], order[:k]


def split_blocks(blocks: Dict[str, torch.Tensor], heldout_fraction: float = 0.1,
                 seed: int = 0) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Deterministic shuffle (by `seed`), then (train, held-out) with at least one block in each."""
    train, held = (torch.from_numpy(i) for i in split_indices(blocks["input_ids"].shape[0], heldout_fraction, seed))
    return ({key: v[train] for key, v in blocks.items()}, {key: v[held] for key, v in blocks.items()})


def first_blocks(blocks: Dict[str, torch.Tensor], n: int) -> Dict[str, torch.Tensor]:
    """The first `n` blocks (all of them when there are fewer)."""
    return {k: v[:n] for k, v in blocks.items()}


def batches(blocks: Dict[str, torch.Tensor], batch_size: int, limit: int = None) -> List[Dict[str, torch.Tensor]]:
    """Consecutive batches of `batch_size` blocks (the last may be smaller); at most `limit` batches."""
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    n = blocks["input_ids"].shape[0]
    out = [{k: v[i:i + batch_size] for k, v in blocks.items()} for i in range(0, n, batch_size)]
    return out[:limit] if limit is not None else out
