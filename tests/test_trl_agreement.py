"""Our instruction label masks agree with TRL's (trl 1.16.0, SFTTrainer's own dataset preparation, read
back from `trainer.train_dataset`), on the embedded SmolLM2 tokenizer.

Prompt-completion records (adept_ext.data.tasks.instruction_blocks vs SFTTrainer with
`completion_only_loss=True`). TRL appends the EOS text to the completion unless it already ends with it,
tokenises the prompt alone and prompt + completion jointly (plain `tokenizer(text)`, so with the
tokenizer's own special tokens), and labels what follows the two's common prefix. We tokenise prompt and
completion apart without special tokens, put the tokenizer's BOS first where it adds one (a BOS-adding copy
of SmolLM2's, whose own adds none, is tested) and append the EOS id. The token ids and the labelled tokens
(completion and EOS) are equal, which is tested, also for a completion that already ends with the EOS
text (neither adds a second EOS), except in one case, pinned below:
- a prompt and completion whose tokens merge across the boundary (a prompt ending with a space): TRL
  trains on the joint tokenisation, " Paris" labelled, and drops the prompt's trailing " " (it warns
  that the model is then trained on a context it does not see at inference); ours keeps the prompt's
  own tokens, " " unlabelled then "Paris", the context the model is given when prompted with the
  prompt alone (ours is the inference-consistent one; TRL's is the more natural tokenisation).

Conversational records (adept_ext.data.chat.chat_blocks vs SFTTrainer with `assistant_only_loss=True`).
TRL's assistant mask is transformers' `return_assistant_tokens_mask`, which needs `{% generation %}`
markers; TRL swaps in a training template of its own only for templates it knows, and SmolLM2's is not
one of them: TRL refuses it (tested), so it cannot compute the mask on SmolLM2's own template. It does
for Qwen2.5's ChatML template, which renders a conversation that opens with a system message to the same
text as SmolLM2's: so ours is computed on SmolLM2's template, TRL's on Qwen2.5's (through its own
swap to `qwen2_5_training.jinja`), and the token ids are equal (tested). Both label each assistant
turn's content and its `<|im_end|>`; TRL's template also puts in the generation span the newline after
`<|im_start|>assistant` (part of the generation prompt, which the model is given, not generates) and the
newline after `<|im_end|>` (never generated: generation stops at `<|im_end|>`), so TRL labels exactly
these two newlines per assistant turn more than ours (tested). Ours labels what the model generates at
inference.
"""
import copy

import pytest
from datasets import Dataset
from tiny_models import tiny_model
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import get_training_chat_template, qwen2_5_chat_template, qwen2_5_training_chat_template

from adept_ext.data import chat, tasks
from adept_ext.models import load_model

BLOCK = 128
PROMPT_COMPLETION = [
    ("Q: What is the capital of France?\nA:", " Paris"),  # one token, with a leading space
    ("Say hello to a friend.", " Hello there, my dear friend! How have you been?"),  # many, leading space
    ("Translate to German: the house\n", "das Haus, nicht die Maus."),  # many, no leading space
    ("Name three colours:", " red, green\nand blue"),  # a newline inside the completion
    ("2+2=", "4"),
]
CONVERSATIONS = [  # each opens with a system message, so SmolLM2's and Qwen2.5's templates render alike
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": " 6 of course, as 3 + 3 = 6."}],
    [{"role": "system", "content": "You translate English into German."},
     {"role": "user", "content": "the house"}, {"role": "assistant", "content": "das Haus\n(neuter)"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("smollm2-135m")[1]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", layers=1, vocab=len(tokenizer))


def trl_rows(tokenizer, model, records, tmp_path, **config):
    """[(input_ids, labelled)] of SFTTrainer's prepared training dataset, one per record, in order."""
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                     activation_checkpointing=False, shuffle_dataset=False, **config)
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(records), args=args)
    rows = [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in trainer.train_dataset]
    assert len(rows) == len(records)
    return rows


def our_rows(blocks):
    """[(input_ids, labelled)] of our blocks without their padding (checked unlabelled); the labels are
    the input ids where labelled."""
    rows = []
    for ids, mask, labels in zip(blocks["input_ids"], blocks["attention_mask"], blocks["labels"], strict=True):
        n = int(mask.sum())
        assert (labels[n:] == -100).all() and ((labels[:n] == -100) | (labels[:n] == ids[:n])).all()
        rows.append((ids[:n].tolist(), (labels[:n] != -100).tolist()))
    return rows


def labelled_text(tokenizer, row):
    ids, labelled = row
    return tokenizer.decode([t for t, on in zip(ids, labelled) if on])


def completions(pairs):
    return [{"prompt": p, "completion": c} for p, c in pairs]


def test_prompt_completion_labels_agree_with_trl(tokenizer, model, tmp_path):
    ours = our_rows(tasks.instruction_blocks(PROMPT_COMPLETION, tokenizer, BLOCK))
    theirs = trl_rows(tokenizer, model, completions(PROMPT_COMPLETION), tmp_path, completion_only_loss=True)
    assert ours == theirs
    for (prompt, completion), row in zip(PROMPT_COMPLETION, ours):  # not vacuous: completion and EOS
        assert labelled_text(tokenizer, row) == completion + tokenizer.eos_token
        assert tokenizer.decode(row[0]) == prompt + completion + tokenizer.eos_token


def test_bos_where_the_tokenizer_adds_one_as_trl(tokenizer, model, tmp_path):
    with_bos = copy.deepcopy(tokenizer)
    with_bos.add_bos_token = True
    assert tokenizer("x")["input_ids"][0] != tokenizer.bos_token_id  # SmolLM2's adds none
    assert with_bos("x")["input_ids"][0] == with_bos.bos_token_id
    ours = our_rows(tasks.instruction_blocks(PROMPT_COMPLETION, with_bos, BLOCK))
    theirs = trl_rows(with_bos, model, completions(PROMPT_COMPLETION), tmp_path, completion_only_loss=True)
    assert ours == theirs
    assert all(ids[0] == with_bos.bos_token_id and not labelled[0] for ids, labelled in ours)


def test_trl_labels_the_joint_tokens_across_a_boundary_we_keep_the_prompts_own(tokenizer, model, tmp_path):
    prompt, completion = "Answer: ", "Paris"
    [ours] = our_rows(tasks.instruction_blocks([(prompt, completion)], tokenizer, BLOCK))
    [theirs] = trl_rows(tokenizer, model, completions([(prompt, completion)]), tmp_path, completion_only_loss=True)
    alone = tokenizer(prompt)["input_ids"]
    assert ours[0] == alone + tokenizer("Paris")["input_ids"] + [tokenizer.eos_token_id]
    assert ours[1] == [False] * len(alone) + [True, True] and tokenizer.decode(alone[-1]) == " "
    assert theirs[0] == tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
    assert theirs[0] == alone[:-1] + tokenizer(" Paris")["input_ids"] + [tokenizer.eos_token_id]
    assert theirs[1] == [False] * (len(alone) - 1) + [True, True]


def test_a_completion_ending_with_eos_gets_no_second_one(tokenizer, model, tmp_path):
    pairs = [("Is it?", " yes" + tokenizer.eos_token)]
    ours = our_rows(tasks.instruction_blocks(pairs, tokenizer, BLOCK))
    assert ours == trl_rows(tokenizer, model, completions(pairs), tmp_path, completion_only_loss=True)


def test_a_long_prompt_is_cut_as_trls_keep_end_cuts_it(tokenizer, model, tmp_path):
    """truncation_mode keep_end: TRL keeps the last max_length tokens of prompt + completion, so a
    long prompt loses its start and the completion stays whole; ours gives the same ids and labels.
    keep_start differs by design: TRL keeps the first tokens (cutting the completion, and drops an
    example left without one); ours keeps the prompt's start and the whole completion."""
    pairs = [(" ".join(f"w{i}" for i in range(40)) + "\nA:", " yes"), PROMPT_COMPLETION[1]]
    short = 24
    ours = our_rows(tasks.instruction_blocks(pairs, tokenizer, short, truncation_mode="keep_end"))
    theirs = trl_rows(tokenizer, model, completions(pairs), tmp_path, completion_only_loss=True, max_length=short,
                      truncation_mode="keep_end")
    assert ours == theirs and len(ours[0][0]) == short  # the first is cut, the second fits
    start = our_rows(tasks.instruction_blocks(pairs, tokenizer, short, truncation_mode="keep_start"))
    assert labelled_text(tokenizer, start[0]) == " yes" + tokenizer.eos_token
    assert start[0][0][:short - 2] == tokenizer(pairs[0][0])["input_ids"][:short - 2]


def test_trl_has_no_training_template_for_smollm2s(tokenizer):
    with pytest.raises(ValueError, match="not training-compatible"):
        get_training_chat_template(tokenizer)


def test_assistant_masks_agree_with_trl_but_for_the_newlines_around_a_turn(tokenizer, model, tmp_path):
    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = qwen2_5_chat_template
    assert get_training_chat_template(qwen) == qwen2_5_training_chat_template  # what TRL swaps in
    ours = our_rows(chat.chat_blocks(CONVERSATIONS, tokenizer, BLOCK, chat.chat_template(tokenizer)))
    theirs = trl_rows(qwen, model, [{"messages": m} for m in CONVERSATIONS], tmp_path, assistant_only_loss=True)
    newline, end = tokenizer("\n")["input_ids"], tokenizer.eos_token_id
    for messages, (ids, labelled), (their_ids, their_labelled) in zip(CONVERSATIONS, ours, theirs, strict=True):
        assert ids == their_ids  # the same text: the masks are comparable token by token
        on = [i for i, x in enumerate(labelled) if x]
        turns = [[i] for i in on[:1]]
        for previous, i in zip(on, on[1:]):  # the labelled runs: one per assistant turn
            if i == previous + 1:
                turns[-1].append(i)
            else:
                turns.append([i])
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode([ids[i] for i in turn]) for turn in turns] == [a + tokenizer.eos_token
                                                                              for a in answers]
        assert all(ids[turn[-1]] == end for turn in turns)  # both label the end-of-turn marker
        around = {i for turn in turns for i in (turn[0] - 1, turn[-1] + 1)}
        assert all([ids[i]] == newline for i in around)
        assert {i for i, x in enumerate(their_labelled) if x} == set(on) | around
