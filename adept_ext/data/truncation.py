"""What `--max-length` does to an instruction example or a conversation longer than it (TRL's
`truncation_mode`, docs/data.md "Longer than --max-length"), and the count of what it cut.

TRL slices the whole tokenised sequence: `keep_start` keeps its first `max_length` tokens,
`keep_end` its last. Here a prompt/answer or prompt/completion example shortens its prompt only
(the answer and EOS are kept whole; an example whose answer and EOS leave no room for a prompt
token is skipped, never cut), and a conversation keeps its first tokens (`keep_start`) or its last
turns, from the start of a user or system turn where one leaves the rest within `max_length`
(`keep_end`). An example left without a token to train on is skipped and counted; a source whose
every example is skipped is an error naming it. Text is cut into blocks of `max_length`: nothing
of it is dropped.
"""
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Sequence

import torch

from ..errors import InputError
from .blocks import pad_rows

MODES = ("keep_end", "keep_start")


@dataclass
class Truncation:
    """A source's examples, and how many of them were cut to `max_length` (`truncated`: kept in
    part) or `skipped` (nothing left to train on)."""

    examples: int = 0
    truncated: int = 0
    skipped: int = 0

    def __str__(self) -> str:
        return (f"{self.examples} examples: {self.truncated} truncated to --max-length, {self.skipped} skipped "
                f"(nothing left to train on)")

    def check(self, source: str, why: str):
        """InputError naming `source` when every example is skipped (`why`: for what)."""
        if self.examples and self.skipped == self.examples:
            raise InputError(f"{source}: every one of its {self.examples} example{'s' * (self.examples > 1)} is "
                             f"skipped: {why}")


class ExampleBlocks(dict):
    """Blocks of examples ({input_ids, attention_mask, labels} [n, max_length]) with their
    `truncation` counts and `examples`, the index in the source of each block's example (those not
    skipped, in order); `blocks.TensorBlocks` keeps them."""

    def __init__(self, tensors: Dict, truncation: Truncation, examples: Sequence[int]):
        super().__init__(tensors)
        self.truncation, self.examples = truncation, list(examples)

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[int]], marks: Sequence[Sequence[bool]], pad: int, width: int,
                truncation: Truncation, examples: Sequence[int]) -> "ExampleBlocks":
        """The one labelling step of instruction and conversational examples: each kept example's
        tokens (`rows`) right-padded with `pad` to `width`, labelled with its own ids where `marks`
        (one per token) is set and -100 elsewhere, padding included."""
        input_ids, attention_mask = pad_rows(rows, pad, width)
        labelled = torch.zeros_like(input_ids, dtype=torch.bool)
        for i, mark in enumerate(marks):
            labelled[i, :len(mark)] = torch.as_tensor(mark, dtype=torch.bool)
        return cls({"input_ids": input_ids, "attention_mask": attention_mask,
                    "labels": input_ids.masked_fill(~labelled, -100)}, truncation, examples)

    def on_every_token(self) -> "ExampleBlocks":
        """The same examples labelled on every token but the padding (`--train-on-prompt`, TRL's
        `completion_only_loss=False`); no tokenisation again."""
        labels = self["input_ids"].masked_fill(self["attention_mask"] == 0, -100)
        return ExampleBlocks({**self, "labels": labels}, self.truncation, self.examples)


def check_mode(mode: str):
    if mode not in MODES:
        raise InputError(f"truncation_mode must be one of {', '.join(MODES)}, got {mode!r}")


def kept(length: int, max_length: int, mode: str, starts: Sequence[int] = ()) -> slice:
    """The tokens kept of a sequence of `length`: all when it fits; else its first `max_length`
    (`keep_start`), or its end (`keep_end`) from the first of the ascending token positions
    `starts` (where a turn begins) that leaves at most `max_length`, else its last `max_length`."""
    check_mode(mode)
    if length <= max_length:
        return slice(0, length)
    if mode == "keep_start":
        return slice(0, max_length)
    return slice(next((s for s in starts if length - s <= max_length), length - max_length), length)


def report_entries(blocks: Dict[str, object], log: Callable[[str], None]) -> Dict[str, Dict[str, int]]:
    """report.json's "data": the counts of each source in `blocks` ({source: its blocks}) read as
    examples (blocks with a `truncation`, as `blocks.TensorBlocks` of `ExampleBlocks` have), each logged."""
    counted = {source: b.truncation for source, b in blocks.items() if getattr(b, "truncation", None)}
    for source, counts in counted.items():
        log(f"{source}: {counts}")
    return {source: asdict(counts) for source, counts in counted.items()}
