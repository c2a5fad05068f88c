"""adept_ext's instruction tasks as lm-eval tasks (adept_ext.evaluation.lm_eval_tasks): the exported items are the
held-out examples the continual runner scores; lm-eval's exact match on them is `answer_scores`' accuracy, item by
item, and its multiple-choice accuracy the argmax over the label set of the labels' summed log-probabilities
computed directly; the built-in names work in --benchmarks without a YAML of the user's; the offline ARC-Easy task
(the whole suite: tests/test_general_suite.py)."""
import json

import pytest
import torch
from tiny_models import write_run_workspace

from adept_ext.evaluation import harness, lm_eval_tasks
from adept_ext.data.blocks import document_bos
from adept_ext.data.tasks import instruction_blocks, load_task
from adept_ext.evaluation.answers import answer_scores

pytest.importorskip("lm_eval")

MAX_LENGTH = 256  # longer than every exported prompt: neither side truncates one
LIMIT = 40  # items per task: what the continual runner scores with --eval-blocks 40


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("lm_eval_tasks"))


def labelled_model(workspace, labels):
    """The tiny model with every label's first token raised above the rest of the vocabulary (a hook on the
    output layer), so that its greedy answer is one of the labels, which one depending on the item: exact
    match and accuracy are neither 0 nor 1. Its context length is raised to MAX_LENGTH (HFLM truncates
    prompts to it; the tiny config says 64)."""
    from adept_ext.models import load_model

    model, tokenizer = load_model(str(workspace / "tiny"))
    model.config.max_position_embeddings = MAX_LENGTH
    bias = torch.zeros(model.config.vocab_size)
    bias[[tokenizer(label, add_special_tokens=False).input_ids[0] for label in labels]] = 50.0
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return model.eval(), tokenizer


def prompt_ids(tokenizer, prompt):
    bos = document_bos(tokenizer)
    return ([] if bos is None else [bos]) + tokenizer(prompt, add_special_tokens=False).input_ids


@torch.no_grad()
def direct_choice(model, tokenizer, item):
    """argmax over the label set of log p(label | prompt), summed over the label's tokens, as adept_ext
    tokenises an example (`instruction_blocks`: the prompt's tokens, then the answer's)."""
    scores = []
    for choice in item["choices"]:
        context, answer = prompt_ids(tokenizer, item["prompt"]), tokenizer(choice, add_special_tokens=False).input_ids
        whole = context + answer
        logp = model(torch.tensor([whole[:-1]])).logits[0].float().log_softmax(-1)
        scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
    return max(range(len(scores)), key=scores.__getitem__)


def samples(path, task):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in sorted(rows, key=lambda r: r["doc_id"]) if r["task"] == task]


@pytest.mark.parametrize("name", ["sms-spam", "bbc-topic"])
def test_lm_eval_scores_the_held_out_items_as_adept_ext_does(workspace, tmp_path, name):
    folder = tmp_path / "tasks"
    stem = lm_eval_tasks.task_id(name)
    assert lm_eval_tasks.export_tasks([name], folder, seed=0) == [f"{stem}_mc", f"{stem}_gen"]
    items = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
    model, tokenizer = labelled_model(workspace, items[0]["choices"])

    # the same items: the exported examples, blocked as adept_ext blocks them, are the runner's held-out blocks
    held = load_task(name, tokenizer, MAX_LENGTH, seed=0).held
    exported = instruction_blocks([(i["prompt"], i["answer"]) for i in items], tokenizer, MAX_LENGTH)
    assert torch.equal(exported["input_ids"], held.tensors()["input_ids"])
    assert all(i["choices"][i["label"]] == i["answer"] and i["answer"].startswith(" ") for i in items)

    scores = harness.evaluate_benchmarks(model, tokenizer, [f"{stem}_mc", f"{stem}_gen"], str(folder), limit=LIMIT,
                                         samples_path=tmp_path / "samples.jsonl")["tasks"]
    first = held.first(LIMIT).tensors()
    right = [answer_scores(model, {k: v[j:j + 1] for k, v in first.items()}, 1, "cpu", tokenizer.eos_token_id)
             ["accuracy"] for j in range(LIMIT)]
    generated = samples(tmp_path / "samples.jsonl", f"{stem}_gen")
    assert [s["exact_match"] for s in generated] == right
    assert scores[f"{stem}_gen"]["metrics"]["exact_match"]["value"] == pytest.approx(sum(right) / LIMIT)
    assert 0 < sum(right) < LIMIT  # neither all right nor all wrong: the comparison means something

    picks = [direct_choice(model, tokenizer, item) for item in items[:LIMIT]]
    chosen = samples(tmp_path / "samples.jsonl", f"{stem}_mc")
    assert [s["acc"] for s in chosen] == [float(p == i["label"]) for p, i in zip(picks, items)]
    assert scores[f"{stem}_mc"]["n"] == LIMIT and scores[f"{stem}_gen"]["n"] == LIMIT


def test_another_seed_holds_out_other_items_under_another_name():
    """Seed 1's items are other items, named adept_TASK_KIND_seed1; a sequence run with --seed 2 refuses the
    names of seed 0's items (some of them are its training examples) and names those of its own."""
    zero, one = (lm_eval_tasks.held_out_items("sms-spam", seed) for seed in (0, 1))
    assert len(zero) == len(one) == 100 and [i["prompt"] for i in zero] != [i["prompt"] for i in one]
    assert lm_eval_tasks.builtin_of("adept_sms_spam_gen_seed1") == ("sms-spam", "gen", 1)
    assert lm_eval_tasks.builtin_of("adept_sms_spam_gen_seed0") is None and lm_eval_tasks.builtin_of("arc_easy") is None
    lm_eval_tasks.check_seed(["adept_sms_spam_gen_seed2", "adept_arc_easy", "hellaswag"], 2)
    with pytest.raises(harness.RunError, match="held out with seed 0.*name adept_sms_spam_mc_seed2 instead"):
        lm_eval_tasks.check_seed(["adept_sms_spam_mc"], 2)


def test_builtin_names_need_no_yaml_of_the_users(workspace, tmp_path, monkeypatch):
    """--benchmarks adept_rt_sentiment_mc,adept_arc_easy,adept_rt_sentiment_gen_seed1: written on demand into the
    cache folders of their seeds, lm-eval's own task index not built; an unknown adept_ name is one error with the
    closest built-in name."""
    monkeypatch.setenv("ADEPT_EXT_CACHE", str(tmp_path / "cache"))
    harness.task_manager.cache_clear()
    model, tokenizer = labelled_model(workspace, [" fresh", " rotten"])
    tasks = ["adept_rt_sentiment_mc", "adept_arc_easy", "adept_rt_sentiment_gen_seed1"]
    harness.check_benchmarks(tasks)
    known = harness.task_manager(tuple(tasks), "").all_tasks
    assert set(tasks) <= set(known) and "arc_easy" not in known  # lm-eval's own tasks not indexed
    scores = harness.evaluate_benchmarks(model, tokenizer, tasks, limit=3)["tasks"]
    assert scores["adept_arc_easy"]["n_total"] == 570 and set(scores["adept_arc_easy"]["metrics"]) == {"acc",
                                                                                                     "acc_norm"}
    assert scores["adept_rt_sentiment_mc"]["n"] == scores["adept_rt_sentiment_gen_seed1"]["n"] == 3
    written = tmp_path / "cache" / "lm_eval_tasks"
    assert (written / "seed-0" / "rt-sentiment.jsonl").exists()
    assert (written / "seed-1" / "rt-sentiment-seed1.jsonl").exists()
    with pytest.raises(harness.RunError, match="did you mean 'adept_sms_spam_gen'"):
        harness.check_benchmarks(["adept_sms_spam_gem"], str(tmp_path / "cache" / "lm_eval_tasks"))


def test_arc_easy_items_are_the_validation_questions():
    from adept_ext.evaluation.general_suite import items as suite_items

    items = suite_items("adept_arc_easy")
    assert len(items) == 570 and len({i["query"] for i in items}) == 570
    assert all(i["query"].startswith("Question: ") and i["query"].endswith("\nAnswer:") for i in items)
    assert all(0 <= i["gold"] < len(i["choices"]) for i in items)


def test_the_export_command(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "export_lm_eval_tasks.py"
    done = subprocess.run([sys.executable, str(tool), "--out", str(tmp_path / "t"), "--tasks", "sms-spam", "--seed",
                           "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        "adept_scoring.py", "adept_sms_spam_gen_seed1.yaml", "adept_sms_spam_mc_seed1.yaml", "sms-spam-seed1.jsonl"]
    items = [json.loads(line) for line in (tmp_path / "t" / "sms-spam-seed1.jsonl").read_text().splitlines()]
    assert items == lm_eval_tasks.held_out_items("sms-spam", 1)
    done = subprocess.run([sys.executable, str(tool), "--out", str(tmp_path / "u"), "--tasks", "mmlu"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no lm-eval export of 'mmlu'" in done.stderr
