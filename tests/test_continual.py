"""The task-sequence runner, its metrics and the continual methods on a tiny real model with the
SmolLM2 tokenizer and real text."""
import json
import math
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from method_spy import TaskSpy, changed_tensors
from tiny_models import tiny_model, write_sequence_workspace
from transformers import AutoModelForCausalLM

from adept_ext import data
from adept_ext.cli import main
from adept_ext.continual import config_from, run
from adept_ext.training.sequence import metrics
from adept_ext.data.tasks import instruction_blocks, load_tasks
from adept_ext.evaluation.answers import answer_scores
from adept_ext.errors import RunError
from adept_ext.methods import Context, create, method_names
from adept_ext.models import load_model

SEQUENCE_METHODS = method_names(sequence=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_sequence_workspace(tmp_path_factory.mktemp("continual"))


def options(ws, out, **kw):
    base = dict(model=str(ws / "tiny"), tasks=f"{ws / 'docs.txt'},{ws / 'topics.jsonl'}", general=str(ws / "general"),
                out=str(ws / out), k=1, max_length=32, batch_size=2, steps=3, warmup_steps=1, probe_blocks=2,
                eval_blocks=3, save_every=2, recompute_every=2, lr=1e-3, lora_rank=2, replay_fraction=0.5)
    base.update(kw)
    return config_from(base)


def quiet(*args):
    pass


def test_metrics_match_a_hand_computed_two_task_matrix():
    matrix = [[-3.0, 0.1],   # base
              [-2.0, 0.3],   # after task 1
              [-2.5, 0.9]]   # after task 2
    m = metrics(matrix)
    assert m["AA"] == pytest.approx((-2.5 + 0.9) / 2)
    assert m["BWT"] == pytest.approx(-2.5 - -2.0)       # a[2][1] - a[1][1]
    assert m["FWT"] == pytest.approx(0.3 - 0.1)         # a[1][2] - a[0][2]
    assert metrics([[1.0], [2.0]]) == {"AA": 2.0, "BWT": None, "FWT": None}


def test_instruction_blocks_label_only_the_answer_and_accuracy_is_exact_match(workspace):
    tokenizer = load_model(workspace / "tiny")[1]
    blocks = instruction_blocks([("Q: two plus two\nA:", " four"), ("x" * 400, " y")], tokenizer, 16)
    answer = tokenizer(" four", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    row = blocks["labels"][0]
    assert row[row != -100].tolist() == answer
    assert blocks["input_ids"].shape == (2, 16) and (blocks["labels"][1] != -100).sum() == 2  # long prompt cut
    model = tiny_model("llama", layers=2, vocab=len(tokenizer))
    base = answer_scores(model, blocks, 2, torch.device("cpu"), tokenizer.eos_token_id)
    assert base["accuracy"] == 0.0 and base["answer_loss"] > 0
    # Plant the answer: an output layer that always predicts " y" gets the second example (only) right.
    head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tokenizer(" y", add_special_tokens=False)["input_ids"][0]] = 1.0
    model.lm_head = head
    planted = answer_scores(model, blocks, 2, torch.device("cpu"), tokenizer.eos_token_id)
    assert planted["accuracy"] == 0.5


def test_train_on_prompt_trains_on_every_token_and_still_scores_the_answers(workspace, tmp_path):
    chats = [{"messages": [{"role": "user", "content": f"Colour number {i}?"},
                           {"role": "assistant", "content": ["red", "green", "blue"][i % 3]}]} for i in range(6)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    tokenizer = load_model(workspace / "tiny")[1]
    (plain,), (everything,) = (load_tasks(str(tmp_path / "chat.jsonl"), tokenizer, 64, 0, train_on_prompt=on)
                               for on in (False, True))
    train = [t.train.tensors() for t in (plain, everything)]
    assert (train[1]["labels"] != -100).sum() > (train[0]["labels"] != -100).sum()
    assert torch.equal(train[1]["labels"], train[1]["input_ids"].masked_fill(train[1]["attention_mask"] == 0, -100))
    assert torch.equal(train[0]["input_ids"], train[1]["input_ids"])  # the same examples: split once
    held = [t.held.tensors() for t in (plain, everything)]
    assert all(torch.equal(held[0][k], held[1][k]) for k in held[0])
    assert plain.replies and everything.replies


def test_train_on_prompt_holds_out_no_training_example_when_truncation_skips_differently(workspace, tmp_path):
    """keep_start at 48 tokens cuts the answer off the long conversations: labelled on every token they
    would be kept, scored on the answer they are skipped; the examples are split once, as labelled on their
    answers, so no held-out row is a training row, and the held-out rows are the answer-labelled ones."""
    chats = [{"messages": [{"role": "user", "content": f"Colour {i}?" + " more" * (i % 4) * 6},
                           {"role": "assistant", "content": f"shade {i}"}]} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    tokenizer = load_model(workspace / "tiny")[1]
    (task,) = load_tasks(str(tmp_path / "chat.jsonl"), tokenizer, 48, 0, train_on_prompt=True,
                         truncation_mode="keep_start")
    train, held = task.train.tensors(), task.held.tensors()
    trained = {tuple(row.tolist()) for row in train["input_ids"]}
    assert len(held["input_ids"]) and not any(tuple(row.tolist()) in trained for row in held["input_ids"])
    assert (held["labels"] != -100).sum() < (held["attention_mask"] == 1).sum()  # scored on the answers
    assert len(train["input_ids"]) + len(held["input_ids"]) < len(chats)  # the answer view skipped some


def test_a_conversational_task_is_scored_by_its_greedy_reply_through_the_end_of_turn(workspace):
    """A conversational example is right exactly when `model.generate` (greedy, through the
    template's generation prompt, stopping at the end-of-turn token) returns the reference reply
    and its end-of-turn token: a model taught "red green blue" gets "red green blue" right and
    "red green" wrong, which the answer rule of prompt/answer tasks (EOS not required) would count
    right."""
    from adept_ext.data.chat import chat_blocks

    tokenizer = load_model(workspace / "tiny")[1]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ask = [{"role": "user", "content": "Colours?"}]
    taught, shorter = (ask + [{"role": "assistant", "content": reply}] for reply in ("red green blue", "red green"))
    blocks = chat_blocks([taught, shorter], tokenizer, 96, tokenizer.chat_template)
    model = tiny_model("llama", layers=2, vocab=len(tokenizer))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = {k: v[:1] for k, v in blocks.items()}
    for _ in range(40):
        optimizer.zero_grad()
        model(**first).loss.backward()
        optimizer.step()
    model.eval()

    def generated_reply_is_right(i):
        prompt = tokenizer.apply_chat_template([taught, shorter][i][:-1], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=end_of_turn,
                             pad_token_id=end_of_turn)[0, prompt.shape[1]:]
        reference = blocks["labels"][i][blocks["labels"][i] != -100]
        return out.tolist() == reference.tolist()

    def scored(i, eos_id=None):
        return answer_scores(model, {k: v[i:i + 1] for k, v in blocks.items()}, 1, torch.device("cpu"),
                             eos_id)["accuracy"]

    assert [generated_reply_is_right(i) for i in (0, 1)] == [True, False]
    assert [scored(i) for i in (0, 1)] == [1.0, 0.0]
    assert scored(1, eos_id=end_of_turn) == 1.0  # the end of turn not required: "red green" counted right
    # The sequence's evaluator scores a conversational task (`replies`) so, an instruction task by the answer.
    from contextlib import nullcontext
    from types import SimpleNamespace

    from adept_ext.training.sequence import Evaluator
    from adept_ext.data.tasks import Task

    held = data.BlockSet(data.TensorBlocks(blocks))
    cfg = SimpleNamespace(eval_blocks=2, batch_size=2, loss_implementation="auto", drift_tokens=0)
    tasks = [Task("chat", "instruction", held, held, replies=True), Task("answers", "instruction", held, held)]
    method = SimpleNamespace(scoring=lambda model, i: nullcontext(model))
    row = Evaluator(cfg, tasks, [blocks], "cpu", end_of_turn, False, method).row(model, "taught")
    assert row["scores"] == [0.5, 1.0]


def note_method_state(record):
    """What a task left in its method before `end_task` clears it: EoupCT's memory and how far
    the task's change lies outside its null space; which of DEAL's filter and update parameters moved."""
    method = record.method
    if getattr(method, "memory", None) is not None:
        record.notes["memory"] = method.memory.k
        record.notes["orthogonality"] = method.memory.orthogonality_error(record.delta())
    if getattr(method, "retain", None):
        ids = {id(p) for p in method.retain + method.updates}
        record.notes["deal_moved"] = [not torch.equal(a, b) for p, a, b in
                                      zip(record.task.trainable, record.after, record.before) if id(p) in ids]


@pytest.mark.parametrize("method", SEQUENCE_METHODS)
def test_every_continual_method_runs_and_keeps_frozen_parts(workspace, monkeypatch, method):
    """The run's files and 3 x 2 score matrix, and what each method does (a method that trains
    nothing, or whose own part does nothing, fails): in every task each trainable tensor moves and
    nothing else does, the text task's held-out loss falls once it is learned, and per method its
    own effect (every parameter trains; only adapted projections change; the buffer holds the
    earlier task's blocks; the penalty is positive; per-unit rates; the null-space projection;
    the filter and update move; each task scored with its own adapter)."""
    spy = TaskSpy(monkeypatch)
    spy.at_finish = note_method_state
    report = run(options(workspace, f"out-{method}", method=method), progress=False, log=quiet)
    out = workspace / f"out-{method}"
    for name in ("report.json", "report.md", "matrix.png", "general.png"):
        assert (out / name).exists()
    assert not (out / "checkpoint.pt").exists() and not (out / ".resume-model").exists()
    assert len(report["matrix"]) == 3 and all(len(r) == 2 for r in report["matrix"])
    assert [t["kind"] for t in report["tasks"]] == ["text", "instruction"]
    assert report["metrics"]["BWT"] is not None and report["trainable_parameters"][0] > 0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    assert not any("lora" in n for n, _ in model.named_parameters())

    assert len(spy.tasks) == 2
    for t, record in enumerate(spy.tasks):
        assert not record.unchanged(), f"task {t + 1}: trainable tensors {record.unchanged()} did not move"
        assert not record.frozen_changed, f"task {t + 1}: frozen {record.frozen_changed} changed"
    matrix = report["matrix"]
    assert matrix[1][0] > matrix[0][0], "the text task's held-out loss did not fall when it was learned"
    first, second = spy.tasks
    if method in ("seq_full", "replay"):  # every parameter trains
        assert not first.frozen and not second.frozen, (sorted(first.frozen)[:3], sorted(second.frozen)[:3])
    if method in ("seq_lora", "o_lora", "osf", "deal", "eoupct", "ewc", "lwf", "agem", "merge_tasks"):  # merged
        targets = ("gate_proj",) if method == "eoupct" else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj")
        changed = changed_tensors(model, base)
        assert changed and all(n.rsplit(".", 2)[-2] in targets for n in changed), changed
    if method == "replay":  # task 2's blocks: its own and max(1, round(0.5 n)) of task 1's n
        every, chosen = second.blocks
        earlier = max(1, round(0.5 * len(every[0])))
        assert len(chosen) == len(every[1]) + earlier, (len(chosen), len(every[1]), earlier)
        task_one = {tuple(row) for row in every[0].tensors()["input_ids"].tolist()}
        assert sum(tuple(row) in task_one for row in chosen.tensors()["input_ids"].tolist()) == earlier
    if method == "o_lora":  # the orthogonality penalty: nothing to be orthogonal to in task 1, positive in task 2
        assert first.penalties and all(terms == [] for terms in first.penalties), first.penalties
        assert second.penalties and all(len(terms) == 1 and terms[0] > 0 for terms in second.penalties), \
            second.penalties
    if method == "ewc":  # no Fisher in task 1, a positive penalty in task 2 (once its adapter moved)
        assert first.penalties and all(terms == [] for terms in first.penalties), first.penalties
        assert second.penalties[-1] and second.penalties[-1][0] > 0, second.penalties
        assert all(0 < t["ewc"]["fisher_rows"] <= 64 for t in report["per_task"]), report["per_task"]
    if method == "agem":  # task 2's steps are checked against the buffer of task 1
        assert "agem" not in report["per_task"][0]
        assert report["per_task"][1]["agem"]["steps"] == report["config"]["steps"]
    if method == "deal":  # task 2 filters and updates task 1's factors: those parameters move, their penalty > 0
        assert second.notes["deal_moved"] and all(second.notes["deal_moved"]), second.notes["deal_moved"]
        assert second.penalties and all(len(terms) == 2 and terms[1] > 0 for terms in second.penalties), \
            second.penalties
    if method == "adept_seq":  # per-unit rates: the units' groups step at different rates
        for record, extras in zip(spy.tasks, report["per_task"]):
            assert record.step_lrs and all(len(set(lrs)) > 1 for lrs in record.step_lrs), record.step_lrs
            assert len(set(extras["unit_rates"]["multipliers"].values())) > 1
    if method == "llama_pro_seq":  # one learning rate
        assert all(record.step_lrs and all(len(set(lrs)) == 1 for lrs in record.step_lrs) for record in spy.tasks)
    if method == "eoupct":  # task 2's change is orthogonal to the memory of task 1's
        assert first.notes["memory"] == 0 and second.notes["memory"] >= 1
        assert second.notes["orthogonality"] <= 1e-4, second.notes
    if method == "per_task":  # task 1 is scored with its own adapter after task 2; the saved model is the base
        assert report["metrics"]["BWT"] == 0 and matrix[2][0] == matrix[1][0]
        assert changed_tensors(model, base) == []
    if method in ("adept_seq", "llama_pro_seq"):
        assert model.config.num_hidden_layers == 6  # one copy per task
        copies = model.config.adept["expanded_layers"]
        originals = [l for i, l in enumerate(model.model.layers) if i not in copies]
        for a, b in zip(base.model.layers, originals):
            assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_adept_seq_freezes_the_first_tasks_copy_during_the_second(workspace):
    cfg = options(workspace, "two-stage", method="adept_seq", tasks=str(workspace / "docs.txt"))
    run(cfg, progress=False, log=quiet)
    after_one = AutoModelForCausalLM.from_pretrained(workspace / "two-stage" / "model")
    copy_one = after_one.config.adept["expanded_layers"][0]
    first_copy = {k: v.clone() for k, v in after_one.model.layers[copy_one].state_dict().items()}
    after_one.save_pretrained(workspace / "after-one")
    load_model(workspace / "tiny")[1].save_pretrained(workspace / "after-one")
    run(options(workspace, "two-stage-b", method="adept_seq", model=str(workspace / "after-one"),
                tasks=str(workspace / "topics.jsonl")), progress=False, log=quiet)
    after_two = AutoModelForCausalLM.from_pretrained(workspace / "two-stage-b" / "model")
    copies = after_two.config.adept["expanded_layers"]
    assert len(copies) == 2
    unchanged = [i for i in copies if all(torch.equal(v, after_two.model.layers[i].state_dict()[k])
                                          for k, v in first_copy.items())]
    assert len(unchanged) == 1, "the first task's copy changed while the second task trained"


def kill_inside_the_second_task(monkeypatch, cfg):
    """Run the sequence `cfg` (4 steps a task) until Ctrl-C after 3 of the second task's steps (a
    checkpoint at step 2), then restore the loop."""
    import adept_ext.training.loop as loop_module

    real = loop_module.train_steps
    calls = {"n": 0}

    def interrupting(*args, after_step, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            def stop_after_three(step):
                after_step(step)
                if step == 3:
                    raise KeyboardInterrupt
            return real(*args, after_step=stop_after_three, **kwargs)
        return real(*args, after_step=after_step, **kwargs)

    monkeypatch.setattr(loop_module, "train_steps", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False, log=quiet)
    monkeypatch.setattr(loop_module, "train_steps", real)
    assert (Path(cfg.out) / "checkpoint.pt").exists()


REPLAY_EVERY_OPTION = dict(replay_base="lora", replay_ratio=0.5, replay_select="surprise", replay_distill=1.0,
                           replay_distill_top_k=5, answer_loss="label_space", ema_decay=0.5)


RESUMED = ("seq_lora", "adept_seq", "o_lora", "osf", "eoupct", "deal", "per_task", "ewc", "lwf", "agem", "merge_tasks")


@pytest.mark.parametrize("method,extra", [(m, {}) for m in RESUMED] + [("replay", REPLAY_EVERY_OPTION)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_kill_inside_the_second_task_and_resume_gives_the_same_result(workspace, monkeypatch, method, extra):
    full = run(options(workspace, f"whole-{method}", method=method, steps=4, **extra), progress=False, log=quiet)
    kill_inside_the_second_task(monkeypatch, options(workspace, f"killed-{method}", method=method, steps=4, **extra))
    import adept_ext.continual as continual_module

    loaded, real_load = [], continual_module.load_model

    def load_model_once_the_last_is_freed(*args, **kwargs):  # its memory check counts the device's free memory
        assert all(model() is None for model in loaded), "the base model is still alive"
        model, tokenizer = real_load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(continual_module, "load_model", load_model_once_the_last_is_freed)
    resumed = run(options(workspace, f"killed-{method}", method=method, steps=4, resume=True, **extra),
                  progress=False, log=quiet)
    assert len(loaded) == 2  # the base model (data, checks), then the model of the completed first task
    flat = lambda m: [v for row in m for v in row]  # noqa: E731
    assert flat(resumed["matrix"]) == pytest.approx(flat(full["matrix"]), rel=1e-5)
    assert resumed["general_loss"] == pytest.approx(full["general_loss"], rel=1e-5)
    assert resumed["kl_to_base"] == pytest.approx(full["kl_to_base"], rel=1e-4)  # the base's distributions kept
    losses = lambda report: [entry["loss"] for task in report["history"] for entry in task]  # noqa: E731
    assert losses(resumed) == pytest.approx(losses(full), rel=1e-5)  # the same batches in the same order
    assert [t.get("replay") for t in resumed["per_task"]] == [t.get("replay") for t in full["per_task"]]
    if method == "replay":  # steps 4 x batch 2, half of each batch from the buffer: 4 replayed rows in task 2
        assert [t["replay"]["replayed_rows"] for t in full["per_task"]] == [0, 4]


@pytest.mark.parametrize("method", ["seq_lora", "seq_full"])
def test_freeze_bottom_keeps_the_embeddings_and_bottom_layers_from_the_second_task_on(workspace, monkeypatch,
                                                                                        method):
    spy = TaskSpy(monkeypatch)
    run(options(workspace, f"bottom-{method}", method=method, freeze_bottom=2), progress=False, log=quiet)
    first, second = spy.tasks
    bottom = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    from adept_ext.merge_back import finished_name as plain  # the name in the merged model
    assert any(plain(n).startswith(bottom) for n in first.names) or method == "seq_lora"  # LoRA: not embeddings
    assert 0 in first.layers() or any("layers.0." in n for n in first.names)
    assert not any(plain(n).startswith(bottom) for n in second.names), second.names
    assert any("layers.3." in n for n in second.names) and not second.frozen_changed
    saved = AutoModelForCausalLM.from_pretrained(workspace / f"bottom-{method}" / "model").state_dict()
    kept = {plain(n): v for n, v in second.frozen.items() if plain(n).startswith(bottom)}  # after task 1
    assert kept and all(torch.equal(saved[n], v) for n, v in kept.items())
    assert not second.unchanged()  # the layers above trained


def test_merge_back_0_after_every_task_keeps_the_base_model(workspace):
    """Averaging with the previous task's model at α = 0 undoes every task: the saved model is the base
    bit for bit and every row scores as the base does."""
    report = run(options(workspace, "averaged", method="seq_lora", merge_back="0"), progress=False, log=quiet)
    assert [t["merge_back"] for t in report["per_task"]] == [{"alpha": 0.0, "schedule": "uniform"}] * 2
    assert all(row == report["matrix"][0] for row in report["matrix"])
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny").state_dict()
    saved = AutoModelForCausalLM.from_pretrained(workspace / "averaged" / "model").state_dict()
    assert all(torch.equal(saved[k], base[k]) for k in base)


@pytest.mark.parametrize("method", ["ewc", "lwf", "agem"])
def test_the_classic_baselines_train_with_frozen_weights_in_bfloat16_and_accumulation(workspace, method):
    """As users train: bf16 autocast, the frozen weights held in bfloat16, 2 micro-batches per step; the
    method's own term is active in task 2 (the Fisher, the teacher, the buffer) and the text task learns."""
    report = run(options(workspace, f"bf16-{method}", method=method, bf16="on", frozen_dtype="bfloat16",
                         grad_accum=2, merge_back="0.5"), progress=False, log=quiet)
    assert report["matrix"][1][0] > report["matrix"][0][0]
    assert all(math.isfinite(v) for row in report["matrix"] for v in row)
    if method == "ewc":
        assert report["per_task"][1]["ewc"]["fisher_rows"] > 0
    if method == "agem":  # the projection ran at every step of task 2
        assert report["per_task"][1]["agem"]["steps"] == report["config"]["steps"]
    assert [t["merge_back"]["alpha"] for t in report["per_task"]] == [0.5, 0.5]


def test_builtin_sequence_tasks(workspace):
    tokenizer = load_model(workspace / "tiny")[1]
    tasks = load_tasks("builtin", tokenizer, 64, 0)
    assert [(t.name, t.kind) for t in tasks] == [("python-docs", "text"), ("python-source", "text"),
                                                 ("bbc-topic", "instruction")]
    topic = tasks[2]
    labelled = topic.held.tensors()["labels"][0]
    answer = tokenizer.decode(labelled[labelled != -100][:-1])
    assert answer.strip() in ("business", "entertainment", "politics", "sports", "tech")


def test_text_tasks_are_memory_mapped_views_with_the_in_memory_blocks_and_split(workspace):
    """A file or folder task goes through Hugging Face datasets (data.corpus_blocks): its splits
    are views of memory-mapped blocks, equal to the in-memory token blocks split the same way."""
    tokenizer = load_model(workspace / "tiny")[1]
    docs, = load_tasks(str(workspace / "docs.txt"), tokenizer, 32, seed=3)
    assert isinstance(docs.train.source.stream, np.memmap)
    train, held = data.split_blocks(data.token_blocks(data.load_texts(str(workspace / "docs.txt")), tokenizer, 32),
                                    0.1, 3)
    for view, tensors in ((docs.train, train), (docs.held, held)):
        assert len(view) == tensors["input_ids"].shape[0]
        assert all(torch.equal(view.tensors()[k], tensors[k]) for k in tensors)
    assert torch.equal(docs.train.first(5).tensors()["input_ids"], train["input_ids"][:5])
    batches = docs.train.batches(4)
    assert len(batches) == -(-len(docs.train) // 4) and torch.equal(batches[1]["input_ids"], train["input_ids"][4:8])


def test_replay_mixes_views_into_the_blocks_the_tensor_mixture_gave(workspace):
    """Replay's buffer and shuffle as views (nothing copied) equal the mixture built from tensors:
    same rows, same order, text and instruction tasks mixed, each row tagged with its slot."""
    import random

    tokenizer = load_model(workspace / "tiny")[1]
    tasks = load_tasks(f"{workspace / 'docs.txt'},{workspace / 'topics.jsonl'}", tokenizer, 32, seed=0)
    method = create("replay", options(workspace, "unused", method="replay", replay_fraction=0.5), sequence=True)
    method.prepare(tiny_model("llama", layers=2), Context(general_probe=[], seed=7))  # the buffer's seed: ctx.seed
    method.kept = {0: method.choose(tasks[0].train)}
    mixed = method.train_blocks([t.train for t in tasks], 1)
    earlier, current = tasks[0].train.tensors(), tasks[1].train.tensors()
    n = earlier["input_ids"].shape[0]
    rows = torch.tensor(method.kept[0])
    assert len(rows) == max(1, round(0.5 * n)) == len(set(method.kept[0]))
    expected = {k: torch.cat([current[k], earlier[k][rows]]) for k in current}
    expected["replay_slot"] = torch.cat([torch.full((len(current["input_ids"]),), -1), torch.arange(len(rows))])
    order = list(range(expected["input_ids"].shape[0]))
    random.Random(7 * 1000 + 1).shuffle(order)
    got = mixed.tensors()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k][torch.tensor(order)]) for k in expected)


@pytest.mark.parametrize("change,message", [
    (dict(tasks="/nonexistent.txt"), "no such file"),
    (dict(tasks="EMPTY"), "holds no text"),
    (dict(tasks="BAD"), "bad.jsonl:1: the record matches no format (its fields: ['prompt'])"),
    (dict(tasks="AMBIGUOUS"), "ambiguous.jsonl:1: the record matches text and prompt/answer"),
    (dict(tasks="MIXED"), "mixed.jsonl:2: a prompt/completion record in a file whose first record is prompt/answer"),
    (dict(tasks="EMPTYANSWER"), "emptyanswer.jsonl:1: an instruction record needs a string 'prompt' and a non-empty "
                                "'completion'"),
    (dict(tasks="CHAT"), "chat.jsonl:1: the conversation has no assistant turn to train on"),
    (dict(chat_template="/nonexistent.jinja"), "--chat-template /nonexistent.jinja: no such file"),
    (dict(tasks="=NONAME"), "give a named task as NAME=SOURCE, both non-empty"),
    (dict(tasks="DUP"), "duplicate task name"),
    (dict(tasks="ONE"), "at least 2 are needed"),
    (dict(method="adept"), "does not learn task sequences"),
    (dict(method="magic"), "unknown method"),
    (dict(replay_fraction=0.0, method="replay"), "replay_fraction must be in"),
    (dict(freeze_bottom=4, method="seq_lora"), "freeze_bottom 4 leaves no layer of the model's 4"),
    (dict(merge_back="auto"), "give continual a number in [0, 1]"),
    (dict(merge_back="0.5", method="per_task"), "per_task does not end a task with one dense model"),
    (dict(o_lora_lambda=-1.0, method="o_lora"), "o_lora_lambda must be >= 0"),
    (dict(deal_a=1.0, method="deal"), "deal_a >= deal_b >= 1 is needed"),
    (dict(eoupct_tau=0.0, method="eoupct"), "eoupct_tau must be > 0"),
])
def test_bad_inputs_are_one_line_errors_and_write_nothing(workspace, tmp_path, capsys, change, message):
    (tmp_path / "empty.txt").write_text("  ")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
    (tmp_path / "ambiguous.jsonl").write_text(json.dumps({"text": "t", "prompt": "x", "answer": "y"}) + "\n")
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n"
                                          + json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    (tmp_path / "emptyanswer.jsonl").write_text(json.dumps({"prompt": "x", "completion": " "}) + "\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    names = {"EMPTY": str(tmp_path / "empty.txt"), "BAD": str(tmp_path / "bad.jsonl"),
             "AMBIGUOUS": str(tmp_path / "ambiguous.jsonl"), "MIXED": str(tmp_path / "mixed.jsonl"),
             "EMPTYANSWER": str(tmp_path / "emptyanswer.jsonl"), "CHAT": str(tmp_path / "chat.jsonl"),
             "=NONAME": f"={workspace / 'docs.txt'}",
             "ONE": str(tmp_path / "one.jsonl"), "DUP": f"{workspace / 'docs.txt'},{workspace / 'docs.txt'}"}
    change = {k: names.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    out = tmp_path / "o"
    argv = ["continual", "--model", str(workspace / "tiny"), "--general", str(workspace / "general"),
            "--tasks", str(workspace / "docs.txt"), "--block-len", "32", "--out", str(out), "--no-progress"]
    for key, value in change.items():
        flag = "--" + key.replace("_", "-")
        argv = argv[:argv.index(flag)] + argv[argv.index(flag) + 2:] if flag in argv else argv
        argv += [flag, str(value)]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("adept-ext: error: ") and message in errors[0]
    assert not out.exists()


def test_errors_before_anything_loads():
    with pytest.raises(RunError, match="unknown option"):
        config_from({"learning_rate": 1.0})


@pytest.mark.parametrize("method", ["seq_lora", "adept_seq"])
def test_gradient_checkpointing_gives_the_same_sequence(workspace, method):
    """--gradient-checkpointing in every task of a sequence: the same losses and scores."""
    runs = [run(options(workspace, f"ckpt-{method}-{on}", method=method, gradient_checkpointing=on), progress=False,
                log=quiet) for on in (False, True)]
    flat = lambda m: [v for row in m for v in row]  # noqa: E731
    assert [h["loss"] for task in runs[1]["history"] for h in task] == pytest.approx(
        [h["loss"] for task in runs[0]["history"] for h in task], rel=1e-6)
    assert flat(runs[1]["matrix"]) == pytest.approx(flat(runs[0]["matrix"]), rel=1e-6)


def test_report_to_tensorboard_writes_scores_and_running_metrics(workspace):
    """continual --report-to tensorboard: each task's training losses on one global step axis, and
    after each task every task's score, the general loss and the running AA / BWT."""
    from test_train import scalars

    report = run(options(workspace, "tracked", method="seq_lora", report_to="tensorboard"), progress=False, log=quiet)
    got = scalars(workspace / "tracked" / "runs")
    steps = report["config"]["steps"]
    assert [s for s, _ in got["train/loss"]] == list(range(1, 2 * steps + 1))
    assert [v for _, v in got["train/loss"]] == pytest.approx([h["loss"] for task in report["history"] for h in task])
    names = [t["name"] for t in report["tasks"]]
    for i, name in enumerate(names):
        assert got[f"continual/score/{name}"] == [(t * steps, pytest.approx(row[i], rel=1e-6))
                                                  for t, row in enumerate(report["matrix"])]
    assert got["eval/general_loss"] == [(t * steps, pytest.approx(g, rel=1e-6))
                                        for t, g in enumerate(report["general_loss"])]
    assert got["eval/kl_to_base"] == [(t * steps, pytest.approx(kl, rel=1e-6))
                                      for t, kl in enumerate(report["kl_to_base"])]
    assert report["kl_to_base"][0] == 0.0 and all(kl > 0 for kl in report["kl_to_base"][1:])
    assert got["continual/AA"][-1] == (2 * steps, pytest.approx(report["metrics"]["AA"], rel=1e-6))
    assert got["continual/BWT"] == [(2 * steps, pytest.approx(report["metrics"]["BWT"], rel=1e-6))]
    assert all(p["tokens_per_second"] > 0 and p["memory_estimate_mb"] > 0 for p in report["per_task"])


def test_mix_general_puts_general_training_blocks_into_every_task(workspace, monkeypatch):
    """--mix-general 0.25 in a sequence: each task trains on its own blocks, every one once and in
    order, with about a quarter general-corpus training blocks among them (never a probe block)."""
    import adept_ext.continual as continual_module

    tokenizer = load_model(workspace / "tiny")[1]
    tasks = load_tasks(f"{workspace / 'docs.txt'},{workspace / 'topics.jsonl'}", tokenizer, 32, seed=0)
    g_train, _ = data.split_views(data.corpus_blocks(str(workspace / "general"), tokenizer, 32), 0, "general")
    rows = lambda batches: [tuple(r.tolist()) for b in batches for r in b["input_ids"]]  # noqa: E731
    probe, general = set(rows(g_train.first(2).batches(2))), set(rows(g_train.batches(2)))
    seen, real = [], continual_module.fit_task

    def recording(model, method, cfg, device, bf16, batches, *args, **kwargs):
        seen.append(rows(batches(None)))
        return real(model, method, cfg, device, bf16, batches, *args, **kwargs)

    monkeypatch.setattr(continual_module, "fit_task", recording)
    run(options(workspace, "mixed-seq", method="seq_lora", mix_general=0.25), progress=False, log=quiet)
    assert len(seen) == len(tasks)
    for task, trained in zip(tasks, seen):
        own = rows(task.train.batches(2))
        assert [r for r in trained if r not in general] == own
        mixed = [r for r in trained if r in general]
        assert not set(mixed) & probe and 0.2 <= len(mixed) / len(trained) <= 0.3


def test_prompt_completion_records_and_named_tasks(workspace, tmp_path):
    """TRL's prompt/completion records make the same instruction blocks as prompt/answer ones; two
    files with one stem run as NAME=SOURCE tasks under their names (without names: a duplicate)."""
    from adept_ext.data.tasks import load_tasks
    from adept_ext.errors import InputError
    from adept_ext.models import load_model

    tokenizer = load_model(str(workspace / "tiny"))[1]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    records = [json.loads(line) for line in (workspace / "topics.jsonl").read_text().splitlines()]
    (tmp_path / "a" / "train.jsonl").write_text((workspace / "topics.jsonl").read_text())
    (tmp_path / "b" / "train.jsonl").write_text("\n".join(json.dumps({"prompt": r["prompt"], "completion": r["answer"]})
                                                          for r in records))
    with pytest.raises(InputError, match="duplicate task name"):
        load_tasks(f"{tmp_path / 'a' / 'train.jsonl'},{tmp_path / 'b' / 'train.jsonl'}", tokenizer, 32, 0)
    answer, completion = load_tasks(f"answers={tmp_path / 'a' / 'train.jsonl'}, completions = "
                                    f"{tmp_path / 'b' / 'train.jsonl'}", tokenizer, 32, 0)
    assert (answer.name, completion.name) == ("answers", "completions")
    assert answer.kind == completion.kind == "instruction"
    for split in ("train", "held"):
        a, c = getattr(answer, split), getattr(completion, split)
        assert len(a) == len(c) > 0
        (a_rows,), (c_rows,) = list(a.batches(len(a))), list(c.batches(len(c)))
        assert all(torch.equal(a_rows[key], c_rows[key]) for key in ("input_ids", "attention_mask", "labels"))


def test_a_conversational_task_trains_on_its_assistant_turns(workspace, tmp_path):
    """A `messages` JSONL task runs in the sequence (rendered with the tokenizer's ChatML template):
    its held-out answer loss (the assistant turns) falls when it is learned."""
    chats = [{"messages": [{"role": "user", "content": f"Colour number {i}?"},
                           {"role": "assistant", "content": ["red", "green", "blue"][i % 3]}]} for i in range(12)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    tasks = f"{workspace / 'docs.txt'},{tmp_path / 'chat.jsonl'}"  # the template adds a system prompt: 64 tokens
    report = run(options(workspace, "chat", method="seq_full", tasks=tasks, steps=4, max_length=64), progress=False,
                 log=quiet)
    rows = report["rows"]
    assert report["tasks"][1]["kind"] == "instruction" and report["tasks"][1]["name"] == "chat"
    assert "through its end-of-turn token" in report["tasks"][1]["scored_by"]
    assert rows[2]["details"][1]["answer_loss"] < rows[0]["details"][1]["answer_loss"]
