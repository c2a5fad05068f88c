"""What a run trains and evaluates on, built from one description: the options of a runner's config
(`adept_ext.train.config_from({...})` or `adept_ext.continual.config_from({...})`; any object with
the attributes named below), so a user's own loop gets exactly the rows the runners use
(docs/api.md, "The runners' data, in your loop"):

    corpora = data.Corpora(cfg, tokenizer)         # one domain: general and domain, train / held-out / probe
    sequence = data.TaskSequence(cfg, tokenizer)   # a task sequence and the general corpus held out from it

Both read sources with weights and interleave them, mix general data into the training batches
(`mix_general`: never a held-out or probe block), pack (`packing`), stream (`streaming`, one domain),
and cut the held-out and probe rows; rank 0 tokenises and caches first under torchrun, the others
then read its cache.
"""
import math
import os
from typing import Dict, List, Tuple

from .. import parallel
from ..errors import InputError, RunError
from .blocks import BlockSet, interleave_blocks, mix_blocks, pad_id, shuffled_view, split_views
from .large_corpus import BlockStream, StreamBatches
from .packing import packed_view
from .tasks import corpus_or_examples, general_blocks, is_instruction_file, load_tasks


def data_workers(options) -> int:
    """Processes that tokenise a file, folder or saved-dataset corpus: `data_workers`, or for 0 the
    CPU count (at most 8)."""
    return options.data_workers or min(8, os.cpu_count() or 1)


def domain_sources(options) -> Tuple[List[str], List[float]]:
    """`domain`'s sources (comma-separated) and their weights (`domain_weights`; equal by default);
    RunError for a weight that is not a finite number > 0, or a count that differs from the sources'."""
    sources = [s.strip() for s in options.domain.split(",") if s.strip()]
    if not sources:
        raise RunError("--domain names no corpus")
    if not options.domain_weights:
        return sources, [1.0] * len(sources)
    try:
        weights = [float(w) for w in options.domain_weights.split(",")]
    except ValueError:
        raise RunError(f"--domain-weights {options.domain_weights}: give comma-separated numbers, e.g. "
                       "0.7,0.3") from None
    if len(weights) != len(sources) or len(sources) < 2:
        raise RunError(f"--domain-weights gives {len(weights)} weight(s) for {len(sources)} --domain source(s): give "
                       f"one per source, and only for several")
    if not all(w > 0 and math.isfinite(w) for w in weights):
        raise RunError(f"--domain-weights {options.domain_weights}: every weight must be a finite number > 0")
    return sources, weights


def packed_rows(rows: BlockSet, options, tokenizer) -> BlockSet:
    """`rows` (documents or examples) packed into training rows of `max_length` (`packing`), else as they are."""
    if not options.packing:
        return rows
    return packed_view(rows, options.max_length, pad_id(tokenizer), options.seed)


class Corpora:
    """Token blocks of both corpora of a one-domain run: general probe + held-out, domain train + held-out.

    Default: each corpus is cut into blocks (`corpus_blocks`: file, folder and saved-dataset corpora
    through Hugging Face datasets, memory-mapped) and split by a seeded shuffle, 10 % held out; the
    training batches are read lazily, with `mix_general` of them general blocks that are neither held
    out nor probe or diagnosis blocks (`general_mixed`). `packing`: a text corpus is one row per
    document (piece), and the training rows of both (domain, general mixed) are packed
    (`packing.packed_view`); held-out, probe and diagnosis rows stay one per row. `streaming`: blocks
    in corpus order (no shuffle, no cache): the first `eval_blocks` are held out, the probe blocks
    follow, the domain's training batches are everything after the held-out blocks, read as the run
    consumes them. Options read: general, domain, domain_weights, domain_eval, max_length, batch_size,
    seed, eval_blocks, probe_blocks, diagnosis_queries, mix_general, packing, streaming, chat_template,
    train_on_prompt, truncation_mode, data_workers."""

    def __init__(self, options, tokenizer):
        self.tokenizer = tokenizer
        self.sources = {}  # each corpus's blocks by its source (report.json's "data": `truncation.report_entries`)
        with parallel.rank_zero_first():  # rank 0 tokenises and caches; the others then read its cache
            self._streamed(options, tokenizer) if options.streaming else self._split(options, tokenizer)

    def _split(self, o, tokenizer):
        def read(source):
            return corpus_or_examples(source, tokenizer, o.max_length, data_workers(o), o.chat_template,
                                      o.train_on_prompt, o.packing, o.truncation_mode)

        sources, weights = domain_sources(o)
        self.sources.update({source: read(source) for source in (o.general, *sources)})
        g_train, g_held = split_views(self.sources[o.general], o.seed, "the general corpus")
        if o.domain_eval:
            d_train = interleave_blocks([shuffled_view(self.sources[s], o.seed) for s in sources], weights, o.seed)
            d_held = BlockSet(read(o.domain_eval))
            self.sources[o.domain_eval] = d_held.source
        else:
            what = (lambda s: "the domain corpus") if len(sources) == 1 else (lambda s: f"the domain corpus {s}")
            trains, helds = zip(*[split_views(self.sources[s], o.seed, what(s)) for s in sources])
            d_train = interleave_blocks(trains, weights, o.seed)
            d_held = interleave_blocks(helds, weights, o.seed, repeat=False)  # each held-out block once
        b = o.batch_size
        self.general_probe = list(g_train.first(o.probe_blocks).batches(b))
        self.general_context = list(g_train.first(o.diagnosis_queries).batches(b))  # diagnosis
        self.general_eval = list(g_held.first(o.eval_blocks).batches(b))
        self.domain_eval = list(d_held.first(o.eval_blocks).batches(b))
        self.general_mixed = g_train.after(max(o.probe_blocks, o.diagnosis_queries))
        train, mixed = (packed_rows(rows, o, tokenizer) for rows in (d_train, self.general_mixed))
        self.domain_train = mix_blocks(train, mixed, o.mix_general, o.seed).batches(b)
        self.domain_probe = list(d_train.first(o.probe_blocks).batches(b))  # placements

    def _streamed(self, o, tokenizer):
        if o.domain_eval:
            raise InputError("--streaming holds out the first --eval-blocks of the domain stream; --domain-eval "
                             "names a held-out set of its own: drop one of them")
        for source in (o.general, o.domain):  # one --domain source (the runner's config_from)
            if is_instruction_file(source):
                raise InputError(f"{source}: instruction and conversational records are read whole, one block per "
                                 f"example; --streaming reads text corpora")
        general, domain = (BlockStream(source, tokenizer, o.max_length) for source in (o.general, o.domain))
        e, b = o.eval_blocks, o.batch_size
        g = general.take(e + max(o.probe_blocks, o.diagnosis_queries))
        d = domain.take(e + o.probe_blocks)
        self.general_eval = general.batches(g[:e], b)
        self.general_probe = general.batches(g[e:e + o.probe_blocks], b)
        self.general_context = general.batches(g[e:e + o.diagnosis_queries], b)
        self.domain_eval = domain.batches(d[:e], b)
        self.domain_probe = domain.batches(d[e:], b)
        self.domain_train = StreamBatches(domain, e, b)


class TaskSequence:
    """The tasks of a sequence (`tasks`: `load_tasks`) and the general corpus held out from every task
    (`general`: `general_blocks`), split by the seed: `general_probe` (the first `probe_blocks` of its
    training split), `general_eval` (the first `eval_blocks` held out), and the rest of its training
    split, from which `mix_general` draws (never a probe or held-out block). `train_batches(t,
    blocks)` gives task t's training batches from the blocks a method trains it on; `domain_probe(t)`
    its probe batches. Options read: tasks, general, max_length, batch_size, seed, eval_blocks,
    probe_blocks, mix_general, packing, chat_template, train_on_prompt, truncation_mode, data_workers."""

    def __init__(self, options, tokenizer):
        o, self.options, self.tokenizer = options, options, tokenizer
        with parallel.rank_zero_first():  # rank 0 tokenises and caches; the others then read its cache
            self.tasks = load_tasks(o.tasks, tokenizer, o.max_length, o.seed, data_workers(o), o.chat_template,
                                    o.train_on_prompt, o.packing, o.truncation_mode)
            general = general_blocks(o.general, tokenizer, o.max_length, data_workers(o), o.packing)
            g_train, g_held = split_views(general, o.seed, "the general corpus")
        self.general_probe = list(g_train.first(o.probe_blocks).batches(o.batch_size))
        self.general_eval = list(g_held.first(o.eval_blocks).batches(o.batch_size))
        self.blocks = [t.train for t in self.tasks]
        self.train_rows = [packed_rows(b, o, tokenizer) for b in self.blocks]
        self.mixed_rows = packed_rows(g_train.after(o.probe_blocks), o, tokenizer)

    @property
    def sources(self) -> Dict:
        """Each task's training blocks by its name (report.json's "data": `truncation.report_entries`)."""
        return {t.name: t.train.source for t in self.tasks}

    def train_batches(self, t: int, train_blocks) -> BlockSet:
        """Task t's training batches: `train_blocks(rows, t)` (the method's choice from every task's
        training rows: its own, or with earlier tasks' for replay) with a `mix_general` share of
        general blocks, seeded per task (`packing`: of packed rows)."""
        o = self.options
        mixed = mix_blocks(train_blocks(self.train_rows, t), self.mixed_rows, o.mix_general, o.seed * 1000 + t)
        return mixed.batches(o.batch_size)

    def domain_probe(self, t: int) -> List:
        """Task t's probe batches: the first `probe_blocks` of its training blocks, one per row."""
        return list(self.blocks[t].first(self.options.probe_blocks).batches(self.options.batch_size))
