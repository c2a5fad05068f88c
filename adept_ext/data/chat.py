"""Conversational examples: OpenAI-style `messages` (alpaca's `instruction`/`input`/`output` and
sharegpt's `conversations` mapped onto them, as LLaMA-Factory maps them) rendered with the
tokenizer's chat template and labelled on the assistant turns (docs/continual.md, "Tasks").

An assistant turn's labelled text starts where the rendering of the conversation before it with
the generation prompt ends, and ends after the first special token (its end-of-turn marker:
ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`, Mistral's `</s>`) after its
content; what a template adds after that marker (a newline) is not labelled. This needs a
template whose rendering of each prefix of a conversation is a prefix of the whole rendering; one
that is not (e.g. one that drops earlier turns' reasoning) is refused. BOS and EOS are the
template's: the rendered text is tokenised without adding special tokens. A conversation longer than
`max_length` is cut by `truncation_mode` (`truncation.kept`), its kept tokens labelled as in the whole
rendering.
"""
import re
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..errors import InputError
from .blocks import pad_id
from .truncation import ExampleBlocks, Truncation, check_mode, kept

ROLES = ("system", "user", "assistant")
SPECIAL_LOOKING = re.compile(r"<\|[^<>|\s]+\|>|<(?:start|end)_of_turn>")  # ChatML/Llama 3's and Gemma's markers
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def messages_of(record: Dict, kind: str, where: str) -> List[Dict[str, str]]:
    """The messages of a `messages`, `alpaca`, `sharegpt` or conversational prompt/completion
    record; InputError naming `where` for a malformed one (a role outside system/user/assistant,
    content that is not a string, no assistant turn, an assistant turn in a prompt)."""
    if kind == "alpaca":
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    elif kind == "sharegpt":
        turns = record["conversations"]
        messages = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                    if isinstance(t, dict) else t for t in turns] if isinstance(turns, list) else turns
    elif kind == "conversational prompt/completion":  # TRL's: the completion's assistant turns are trained
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(completion, list) and all(isinstance(m, dict) for m in prompt + completion)):
            raise InputError(f"{where}: a conversational prompt/completion record has lists of turns as its "
                             f"'prompt' and 'completion'")
        if any(m.get("role") == "assistant" for m in prompt):
            raise InputError(f"{where}: an assistant turn in the prompt would be trained on (only the "
                             f"completion is, in TRL's prompt/completion); give the conversation as 'messages'")
        messages = prompt + completion
    else:
        messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)):
        raise InputError(f"{where}: a conversation is a non-empty list of turns, each a role ({', '.join(ROLES)}) "
                         f"and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: the conversation has no assistant turn to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_template(tokenizer, path: str = "") -> str:
    """The template to render with: the file `path` (Jinja, as `--chat-template`), else the
    tokenizer's; InputError when there is none."""
    if path:
        if not Path(path).is_file():
            raise InputError(f"--chat-template {path}: no such file")
        return Path(path).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("conversational data needs a chat template and the tokenizer has none: give one with "
                         "--chat-template FILE (a Jinja template, e.g. the chat_template of the model's instruct "
                         "variant's tokenizer_config.json)")
    return tokenizer.chat_template


def render(tokenizer, messages, template: str, generation: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation)
    except Exception as e:  # the template's own raise_exception (e.g. no system role, roles not alternating)
        raise InputError(f"{where}: the chat template refuses the conversation: {e}") from e


def assistant_spans(tokenizer, messages, template: str, where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content and the
    end-of-turn marker); InputError for a template that is not prefix-stable."""
    full = render(tokenizer, messages, template, False, where)
    vocabulary = tokenizer.get_vocab()
    unknown = sorted({t for t in SPECIAL_LOOKING.findall(full) if t not in vocabulary})
    if unknown:
        raise InputError(f"{where}: the chat template writes {', '.join(unknown)}, which the tokenizer does not have "
                         f"as tokens (a template of another model family?); give the model's own with --chat-template")
    markers = [t for t in tokenizer.all_special_tokens if t]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], template, True, where) if i else ""
        upto = render(tokenizer, messages[:i + 1], template, False, where)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise InputError(f"{where}: the chat template is not prefix-stable (the conversation up to turn {i + 1} "
                             f"does not render as a prefix of the whole conversation, as with a template that drops "
                             f"earlier turns' text), so its assistant turns cannot be located; give one that is with "
                             f"--chat-template FILE")
        content = upto.find(message["content"], len(before))
        after = content + len(message["content"]) if content >= 0 else len(before)
        ends = [upto.find(m, after) + len(m) for m in markers if upto.find(m, after) >= 0]
        spans.append((len(before), min(ends) if ends else len(upto)))
    return full, spans


def turn_starts(tokenizer, messages, template: str, text: str, offsets, where: str) -> List[int]:
    """The token positions in `text` (the rendered conversation, tokens at character `offsets`)
    where a user or system turn after the first begins: where the rendering of the turns before it
    ends, when that is a prefix of `text`."""
    starts = []
    for i, message in enumerate(messages[1:], 1):
        before = render(tokenizer, messages[:i], template, False, where)
        if message["role"] != "assistant" and text.startswith(before):
            starts.append(next((t for t, (a, _) in enumerate(offsets) if a >= len(before)), len(offsets)))
    return starts


def chat_blocks(conversations: Sequence[List[Dict[str, str]]], tokenizer, max_length: int, template: str,
                train_on_prompt: bool = False, where: Sequence[str] = (), truncation_mode: str = "keep_end",
                source: str = "the conversations") -> ExampleBlocks:
    """One right-padded block per conversation, labelled on its assistant turns (every token with
    `train_on_prompt`). A conversation longer than `max_length` tokens keeps its first ones
    (`keep_start`) or its last turns (`keep_end`, from a user or system turn's start where one
    fits, else its last `max_length` tokens), labelled as in the whole rendering; one left without
    a labelled token to predict is skipped (`truncation`), and InputError naming `source` when
    every one is."""
    check_mode(truncation_mode)
    rows, labels, counts, examples = [], [], Truncation(len(conversations)), []
    for n, messages in enumerate(conversations):
        place = where[n] if n < len(where) else f"conversation {n + 1}"
        text, spans = assistant_spans(tokenizer, messages, template, place)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        starts = (turn_starts(tokenizer, messages, template, text, offsets, place)
                  if len(ids) > max_length and truncation_mode == "keep_end" else ())
        keep = kept(len(ids), max_length, truncation_mode, starts)
        marks = [any(a <= start < b for a, b in spans) for start, _ in offsets[keep]]
        if not (any(marks[1:]) or train_on_prompt and len(marks) > 1):  # the first token is never a target
            counts.skipped += 1
            continue
        counts.truncated += len(marks) < len(ids)
        rows.append(ids[keep])
        labels.append(marks)
        examples.append(n)
    counts.check(source, f"none keeps an assistant token to train on within --max-length {max_length} "
                         f"(truncation_mode {truncation_mode}); raise --max-length or choose the other truncation_mode")
    blocks = ExampleBlocks.of_rows(rows, labels, pad_id(tokenizer), max_length, counts, examples)
    return blocks.on_every_token() if train_on_prompt else blocks
