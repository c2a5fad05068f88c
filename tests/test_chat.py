"""Conversational records rendered with a chat template and labelled on the assistant turns
(adept_ext/data/chat.py), on templates of the ChatML, Llama 3, Gemma and Mistral kinds."""
import copy
import json

import pytest

from adept_ext.data.chat import chat_blocks, chat_template, messages_of
from adept_ext.data.tasks import load_tasks
from adept_ext.errors import InputError
from adept_ext.models import load_model

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
           "{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
LAST_TURN_ONLY = "{% for m in messages[-1:] %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + " \
                 "'<|im_end|>\\n' }}{% endfor %}" \
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6 of course"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2-135m")[1]


def labelled(tokenizer, blocks, row=0):
    labels = blocks["labels"][row]
    return [tokenizer.decode([t]) for t in labels[labels != -100].tolist()]


def with_tokens(tokenizer, *tokens):
    extended = copy.deepcopy(tokenizer)
    extended.add_special_tokens({"additional_special_tokens": list(tokens)})
    return extended


def test_chatml_labels_the_assistant_turns_and_their_end_of_turn_only(tokenizer):
    blocks = chat_blocks([CONVERSATION], tokenizer, 96, chat_template(tokenizer))
    assert labelled(tokenizer, blocks) == ["4", "<|im_end|>", "6", " of", " course", "<|im_end|>"]
    text = tokenizer.decode(blocks["input_ids"][0][blocks["attention_mask"][0] == 1])
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith("6 of course<|im_end|>\n")
    everything = chat_blocks([CONVERSATION], tokenizer, 96, chat_template(tokenizer), train_on_prompt=True)
    assert (everything["labels"] != -100).sum() == blocks["attention_mask"].sum()


def test_llama3_and_gemma_kinds(tokenizer):
    llama = with_tokens(tokenizer, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    blocks = chat_blocks([CONVERSATION], llama, 96, LLAMA3)
    assert labelled(llama, blocks) == ["4", "<|eot_id|>", "6", " of", " course", "<|eot_id|>"]
    llama.add_bos_token = True  # a tokenizer that adds BOS: the template's BOS is the only one
    ids = chat_blocks([CONVERSATION], llama, 96, LLAMA3)["input_ids"][0].tolist()
    assert ids[0] == llama.bos_token_id and ids.count(llama.bos_token_id) == 1
    gemma = with_tokens(tokenizer, "<start_of_turn>", "<end_of_turn>")
    blocks = chat_blocks([CONVERSATION[1:]], gemma, 96, GEMMA)  # the "\n" after <end_of_turn> is not labelled
    assert labelled(gemma, blocks) == ["4", "<end_of_turn>", "6", " of", " course", "<end_of_turn>"]
    with pytest.raises(InputError, match="the chat template refuses the conversation: System role not supported"):
        chat_blocks([CONVERSATION], gemma, 96, GEMMA, where=["f.jsonl:3"])


def test_mistral_kind_checks_alternation_and_labels_through_eos(tokenizer):
    pairs = CONVERSATION[1:]
    blocks = chat_blocks([pairs], tokenizer, 96, MISTRAL)
    assert "".join(labelled(tokenizer, blocks)).replace(" ", "") == "4<|im_end|>6ofcourse<|im_end|>"
    with pytest.raises(InputError, match="f.jsonl:2: the chat template refuses the conversation: Conversation roles"):
        chat_blocks([[pairs[0], pairs[0], pairs[1]]], tokenizer, 96, MISTRAL, where=["f.jsonl:2"])


def test_templates_that_cannot_be_labelled_are_refused(tokenizer):
    with pytest.raises(InputError, match="f.jsonl:1: the chat template is not prefix-stable"):
        chat_blocks([CONVERSATION], tokenizer, 96, LAST_TURN_ONLY, where=["f.jsonl:1"])
    with pytest.raises(InputError, match=r"writes <\|end_header_id\|>, <\|eot_id\|>, <\|start_header_id\|>, which"):
        chat_blocks([CONVERSATION], tokenizer, 96, LLAMA3)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(InputError, match="--chat-template FILE"):
        chat_template(plain)


def test_alpaca_and_sharegpt_are_the_same_conversations(tokenizer):
    alpaca = {"instruction": "What is 2+2?", "input": "", "output": "4", "system": "Be brief."}
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2+2?"},
                                  {"from": "gpt", "value": "4"}]}
    assert messages_of(alpaca, "alpaca", "a") == messages_of(sharegpt, "sharegpt", "s") == CONVERSATION[:3]
    assert messages_of({"instruction": "Sum", "input": "2 2", "output": "4"}, "alpaca", "a")[0] == \
        {"role": "user", "content": "Sum\n\n2 2"}
    for bad in ({"conversations": [{"from": "robot", "value": "x"}]},
                {"conversations": [{"from": "human", "value": 3}]},
                {"conversations": [{"from": "human", "value": "no answer"}]}):
        with pytest.raises(InputError, match="s.jsonl:4: "):
            messages_of(bad, "sharegpt", "s.jsonl:4")


def test_a_conversational_task_in_every_format_gives_the_same_blocks(tokenizer, tmp_path):
    conversations = [[{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": str(2 * i)}]
                     for i in range(6)]
    forms = {
        "messages": [{"messages": c} for c in conversations],
        "alpaca": [{"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in conversations],
        "sharegpt": [{"conversations": [{"from": "human", "value": c[0]["content"]},
                                        {"from": "gpt", "value": c[1]["content"]}]} for c in conversations],
        "prompt_completion": [{"prompt": c[:1], "completion": c[1:]} for c in conversations],  # TRL's, as turns
    }
    tasks = {}
    for name, records in forms.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        (tasks[name],) = load_tasks(str(tmp_path / f"{name}.jsonl"), tokenizer, 48, 0)
    rows = {name: next(iter(task.train.batches(len(task.train)))) for name, task in tasks.items()}
    for name in ("alpaca", "sharegpt", "prompt_completion"):
        assert all((rows[name][k] == rows["messages"][k]).all() for k in ("input_ids", "labels"))
    assert tasks["messages"].kind == "instruction" and tasks["prompt_completion"].replies
    history = {"prompt": conversations[0], "completion": conversations[1][1:]}  # an answered turn in the prompt
    (tmp_path / "history.jsonl").write_text(json.dumps(history))
    with pytest.raises(InputError, match="history.jsonl:1: an assistant turn in the prompt"):
        load_tasks(str(tmp_path / "history.jsonl"), tokenizer, 48, 0)


def test_the_data_formats_page_shows_one_example_file_per_format_and_each_reads(tokenizer):
    """docs/data.md links one example file per format of `RECORD_FORMATS` (and TRL's conversational
    prompt/completion), and each one reads
    (`corpus_or_examples`): the text file as text blocks, the others one labelled block per record."""
    from pathlib import Path

    from adept_ext.data.tasks import RECORD_FORMATS, corpus_or_examples, is_instruction_file

    docs = Path(__file__).resolve().parents[1] / "docs"
    page = (docs / "data.md").read_text()
    files = {name: docs / "examples" / "data" / f"{name.replace('/', '_').replace(' ', '_')}.jsonl"
             for name in (*RECORD_FORMATS, "conversational prompt/completion")}
    for name, path in files.items():
        assert f"(examples/data/{path.name})" in page, name
        blocks = corpus_or_examples(str(path), tokenizer, 64)
        assert is_instruction_file(str(path)) == (name != "text")
        rows = blocks.rows(list(range(len(blocks))))
        assert (rows["labels"] != -100).any(dim=1).all(), name
        if name != "text":
            assert len(blocks) == len(path.read_text().splitlines()), name
            assert ((rows["labels"] != -100).sum(dim=1) < rows["attention_mask"].sum(dim=1)).all(), name
