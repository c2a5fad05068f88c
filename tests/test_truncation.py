"""Examples longer than --max-length (adept_ext/data/truncation.py): the truncation modes on
prompt/answer, prompt/completion and multi-turn conversations, what is skipped and counted, and
the counts in the report of both runners."""
import json

import pytest
from tiny_models import write_sequence_workspace

from adept_ext.data.chat import chat_blocks, chat_template
from adept_ext.data.tasks import instruction_blocks, instruction_file_blocks
from adept_ext.data.truncation import Truncation, kept
from adept_ext.errors import InputError, RunError
from adept_ext.models import load_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6 of course"}]
LONG_PROMPT = "Question: " + " ".join(f"word{i}" for i in range(30)) + "\nAnswer:"
LONG_ANSWER = " " + " ".join(f"part{i}" for i in range(30))


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2-135m")[1]


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rows(blocks):
    """[(ids, labels)] of the blocks without their padding."""
    return [(i[m == 1].tolist(), lab[m == 1].tolist())
            for i, m, lab in zip(blocks["input_ids"], blocks["attention_mask"], blocks["labels"], strict=True)]


def test_kept_keeps_the_start_the_end_or_the_end_from_a_turn():
    assert kept(5, 8, "keep_start") == kept(5, 8, "keep_end") == slice(0, 5)
    assert kept(10, 4, "keep_start") == slice(0, 4)
    assert kept(10, 4, "keep_end") == slice(6, 10)
    assert kept(10, 6, "keep_end", starts=[3, 5, 8]) == slice(5, 10)  # the first turn start that fits
    assert kept(10, 3, "keep_end", starts=[3, 5]) == slice(7, 10)  # none fits: the last tokens
    with pytest.raises(InputError, match="truncation_mode must be one of keep_end, keep_start, got 'left'"):
        kept(10, 4, "left")


@pytest.mark.parametrize("field", ["answer", "completion"])
def test_a_long_prompt_keeps_its_end_or_start_and_the_whole_answer(tokenizer, tmp_path, field):
    """prompt/answer and prompt/completion: the prompt is shortened (keep_end: its last tokens, the
    left cut of before; keep_start: its first), the answer and EOS kept whole and alone labelled; an
    example whose answer and EOS leave no room for a prompt token is skipped and counted."""
    examples = [(LONG_PROMPT, " yes"), ("Short?", " no"), ("Why?", LONG_ANSWER)]
    path = tmp_path / f"{field}.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, field: a}) for p, a in examples))
    eos, width = tokenizer.eos_token_id, 24
    prompt, answer = ids(tokenizer, LONG_PROMPT), ids(tokenizer, " yes") + [eos]
    room = width - len(answer)
    assert len(prompt) > room and len(ids(tokenizer, LONG_ANSWER)) + 1 >= width
    expected = {"keep_end": prompt[-room:], "keep_start": prompt[:room]}
    for mode, kept_prompt in expected.items():
        blocks = instruction_file_blocks(path, tokenizer, width, truncation_mode=mode)
        assert vars(blocks.truncation) == vars(Truncation(examples=3, truncated=1, skipped=1))
        long, short = rows(blocks.blocks)
        assert long == (kept_prompt + answer, [-100] * room + answer)
        assert short == rows(instruction_blocks([examples[1]], tokenizer, 64))[0]  # fits: as it was
    with pytest.raises(InputError, match=f"{path}: every one of its 1 example"):
        instruction_blocks([examples[2]], tokenizer, width, source=str(path))


def test_keep_end_is_the_left_cut_of_before_for_every_example_whose_answer_fits(tokenizer):
    """The default (keep_end) keeps the numbers of the code before truncation modes: the prompt cut
    from the left to fit, for over-long and fitting prompts alike; keep_start agrees where nothing is cut."""
    examples = [(LONG_PROMPT, " yes"), ("Short?", " no"), ("2+2=", "4"), (LONG_PROMPT, LONG_ANSWER[:60])]
    eos, width = tokenizer.eos_token_id, 64
    before = []
    for prompt, answer in examples:
        a = ids(tokenizer, answer) + [eos]
        p = ids(tokenizer, prompt)[-(width - len(a)):]
        before.append((p + a, [-100] * len(p) + a))
    assert rows(instruction_blocks(examples, tokenizer, width)) == before
    fitting = examples[1:3]
    assert rows(instruction_blocks(fitting, tokenizer, width, truncation_mode="keep_start")) == before[1:3]
    assert vars(instruction_blocks(fitting, tokenizer, width).truncation) == vars(Truncation(2))


@pytest.mark.parametrize("width", [16, 24, 30, 40])
def test_a_long_conversation_keeps_its_first_tokens_or_its_last_turns_labelled_as_rendered(tokenizer, width):
    """keep_start keeps the first tokens, keep_end the last turns from a user turn's start (or, when
    even the last one is too long, the last tokens); the kept tokens carry exactly the labels of the
    whole rendering at the same tokens; nothing of a conversation that fits changes."""
    template = chat_template(tokenizer)
    [(whole, labels)] = rows(chat_blocks([CONVERSATION], tokenizer, 96, template))
    assert len(whole) > 40
    for mode in ("keep_start", "keep_end"):
        assert rows(chat_blocks([CONVERSATION], tokenizer, 96, template, truncation_mode=mode)) == [(whole, labels)]
    if width >= 30:  # keep_start keeps an assistant turn
        start = chat_blocks([CONVERSATION], tokenizer, width, template, truncation_mode="keep_start")
        assert rows(start) == [(whole[:width], labels[:width])]
        assert vars(start.truncation) == vars(Truncation(1, truncated=1))
    end = chat_blocks([CONVERSATION], tokenizer, width, template, truncation_mode="keep_end")
    [(tail, tail_labels)] = rows(end)
    begin = len(whole) - len(tail)
    assert (tail, tail_labels) == (whole[begin:], labels[begin:])
    text = tokenizer.decode(tail)
    if width >= 20:  # the last user turn and its answer fit: the kept text starts at a turn
        assert text.startswith("<|im_start|>user\n") and len(tail) <= width
        assert text.startswith("<|im_start|>user\nWhat is 2+2?") == (width >= 39)
    else:
        assert len(tail) == width and not text.startswith("<|im_start|>")
    assert any(x != -100 for x in tail_labels[1:])


def test_a_conversation_left_without_an_assistant_token_is_skipped_and_counted(tokenizer):
    template = chat_template(tokenizer)
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}]
    blocks = chat_blocks([CONVERSATION, short], tokenizer, 24, template, truncation_mode="keep_start")
    assert vars(blocks.truncation) == vars(Truncation(2, truncated=0, skipped=1))
    assert rows(blocks) == rows(chat_blocks([short], tokenizer, 24, template))
    with pytest.raises(InputError, match="chats.jsonl: every one of its 1 example.*keep_start"):
        chat_blocks([CONVERSATION], tokenizer, 24, template, truncation_mode="keep_start", source="chats.jsonl")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_sequence_workspace(tmp_path_factory.mktemp("truncation"))


def answers_file(path, n_long_prompt, n_long_answer, n_short):
    records = ([{"prompt": f"{LONG_PROMPT} {i}", "answer": " yes"} for i in range(n_long_prompt)]
               + [{"prompt": f"Why {i}?", "answer": LONG_ANSWER} for i in range(n_long_answer)]
               + [{"prompt": f"Is {i} even?", "answer": [" yes", " no"][i % 2]} for i in range(n_short)])
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def test_a_run_reports_what_was_truncated_and_skipped_and_refuses_a_file_with_nothing_left(workspace, tmp_path):
    from adept_ext.train import config_from, run

    domain = answers_file(tmp_path / "answers.jsonl", 4, 3, 8)
    base = dict(model=str(workspace / "tiny"), general=str(workspace / "general"), domain=domain, max_length=32,
                batch_size=2, steps=2, warmup_steps=1, probe_blocks=2, eval_blocks=2, eval_every=0, method="lora",
                lr=1e-3)
    lines = []
    report = run(config_from({**base, "out": str(tmp_path / "out")}), progress=False, log=lines.append)
    assert report["data"] == {domain: {"examples": 15, "truncated": 4, "skipped": 3}}
    assert json.loads((tmp_path / "out" / "report.json").read_text())["data"] == report["data"]
    assert f"{domain}: 15 examples: 4 truncated to --max-length, 3 skipped (nothing left to train on)" in lines
    nothing = answers_file(tmp_path / "nothing.jsonl", 0, 4, 0)
    with pytest.raises(RunError, match=f"{nothing}: every one of its 4 examples is skipped: each answer"):
        run(config_from({**base, "domain": nothing, "out": str(tmp_path / "never")}), progress=False,
            log=lambda *a: None)
    assert not (tmp_path / "never").exists()


def test_a_sequence_reports_what_was_truncated_per_task(workspace, tmp_path):
    from adept_ext.continual import config_from, run

    def chat(i):  # 38 tokens with SmolLM2's system prompt; 0 and 1: a question of 74; 2: a reply of 78
        question, reply = f"Colour number {i}?" + " Think hard." * 12 * (i < 2), "red " * (40 if i == 2 else 1)
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply.strip()}]}

    chats = [chat(i) for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    cfg = config_from(dict(model=str(workspace / "tiny"), tasks=f"{workspace / 'docs.txt'},{tmp_path / 'chat.jsonl'}",
                           general=str(workspace / "general"), out=str(tmp_path / "seq"), method="seq_lora",
                           max_length=64, batch_size=2, steps=1, warmup_steps=0, probe_blocks=2, eval_blocks=2,
                           lora_rank=2, truncation_mode="keep_start"))
    report = run(cfg, progress=False, log=lambda *a: None)
    # keep_start: the long questions leave no reply within 64 tokens, the long reply keeps its start
    assert report["data"] == {"chat": {"examples": 8, "truncated": 1, "skipped": 2}}  # the text task: none
    assert json.loads((tmp_path / "seq" / "report.json").read_text())["data"] == report["data"]
