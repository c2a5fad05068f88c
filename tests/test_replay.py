"""Replay's buffer (selection, rate) and its distillation, each against a direct computation."""
from collections import Counter

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

import adept_ext
from adept_ext import data
from adept_ext.errors import InputError
from adept_ext.hf import MethodCallback
from adept_ext.lm_loss import final_hidden
from adept_ext.methods import ReplayConfig, get_method
from adept_ext.methods.pseudo_examples import label_examples, pseudo_examples
from adept_ext.methods.replay import SLOT, row_losses, top_k_log_probs

VOCAB = 40
ANSWERS = {"a": [5, 6], "b": [7], "c": [8, 9]}


def rows_with_answers(names, width=12, seed=0):
    """Instruction-like rows: random prompt tokens, then the answer's tokens (labelled), then padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, VOCAB, (len(names), width), generator=g)
    labels = torch.full_like(ids, -100)
    mask = torch.ones_like(ids)
    for i, name in enumerate(names):
        answer = ANSWERS[name]
        start = 6 + i % 3
        ids[i, start:start + len(answer)] = torch.tensor(answer)
        labels[i, start:start + len(answer)] = torch.tensor(answer)
        mask[i, start + len(answer):] = 0
        ids[i, start + len(answer):] = 0
    return data.BlockSet(data.TensorBlocks({"input_ids": ids, "attention_mask": mask, "labels": labels}))


def replay(seed=0, task_index=1, **options):
    method = get_method(ReplayConfig(**options))
    method.seed, method.task_index = seed, task_index
    return method


def test_the_ratio_draws_that_share_of_every_batch_from_the_buffer_repeating_it():
    own, earlier = rows_with_answers(["a"] * 24, seed=1), rows_with_answers(["b"] * 40)
    method = replay(ratio=0.25)
    method.kept = {0: [3, 17]}
    mixed = method.train_blocks([earlier, own], 1)
    slots = [batch[SLOT] for batch in mixed.batches(4)]
    assert all(int((s >= 0).sum()) == 1 for s in slots), [s.tolist() for s in slots]
    assert len(mixed) == 32  # every own row once, one buffer row in four
    rows = mixed.tensors()
    own_rows = {tuple(r) for r in own.tensors()["input_ids"].tolist()}
    assert sorted(tuple(r) for r in rows["input_ids"][rows[SLOT] < 0].tolist()) == sorted(own_rows)
    replayed = rows["input_ids"][rows[SLOT] >= 0]
    kept = earlier.tensors()["input_ids"][[3, 17]]
    assert len(replayed) == 8 and all(any(torch.equal(r, k) for k in kept) for r in replayed)  # 2 rows, 4 times each
    assert torch.equal(rows[SLOT][rows[SLOT] >= 0].sort().values, torch.tensor([0] * 4 + [1] * 4))


def test_without_a_ratio_each_buffer_row_is_trained_once():
    own, earlier = rows_with_answers(["a"] * 24, seed=1), rows_with_answers(["b"] * 40)
    method = replay()
    method.kept = {0: [3, 17]}
    rows = method.train_blocks([earlier, own], 1).tensors()
    assert len(rows["input_ids"]) == 26 and sorted(rows[SLOT].tolist()) == [-1] * 24 + [0, 1]


def test_a_task_without_a_buffer_of_the_earlier_ones_is_refused():
    with pytest.raises(InputError, match=r"no buffer of task\(s\) \[1\]"):
        replay().train_blocks([rows_with_answers(["a"]), rows_with_answers(["b"])], 1)


def test_balanced_keeps_the_same_count_of_every_answer_random_does_not():
    rows = rows_with_answers(["a"] * 30 + ["b"] * 6 + ["c"] * 2)
    answers = [tuple(r[r != -100].tolist()) for r in rows.tensors()["labels"]]
    counts = lambda kept: sorted(Counter(answers[i] for i in kept).values())  # noqa: E731
    balanced = replay(select="balanced", fraction=0.25, task_index=0).choose(rows)
    assert len(balanced) == 10 and len(set(balanced)) == 10
    assert counts(balanced) == [2, 4, 4]  # c has only two rows; a and b share the rest equally
    drawn = replay(fraction=0.25, task_index=0).choose(rows)
    assert len(drawn) == 10 and counts(drawn) != [2, 4, 4]


def test_surprise_keeps_the_rows_of_highest_loss_under_the_model():
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    rows = rows_with_answers(["a", "b", "c"] * 5)
    batch = rows.tensors()
    direct = torch.stack([model(input_ids=batch["input_ids"][i:i + 1], attention_mask=batch["attention_mask"][i:i + 1],
                                labels=batch["labels"][i:i + 1]).loss for i in range(15)]).detach()
    torch.testing.assert_close(row_losses(model, rows), direct, rtol=1e-5, atol=1e-6)
    kept = replay(select="surprise", fraction=0.2, task_index=0).choose(rows, row_losses(model, rows))
    assert kept == sorted(direct.argsort(descending=True)[:3].tolist())


def labelled_log_probs(model, batch):
    """(row, position, log-softmax [P, V]) at every position whose next token is labelled: from the full logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    row, position = (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)
    return row, position, logits[row, position].float().log_softmax(-1)


def test_the_stored_top_k_and_the_distillation_equal_a_direct_computation():
    teacher = tiny_model("llama", layers=2, vocab=VOCAB)
    earlier = rows_with_answers(["a", "b", "c", "a", "c"], seed=2)
    k, alpha = 6, 0.7
    stored = top_k_log_probs(teacher, earlier, k)
    with torch.no_grad():
        row, position, logp = labelled_log_probs(teacher, earlier.tensors())
    top = logp.topk(k, dim=-1)
    assert torch.equal(stored["positions"], position) and torch.equal(stored["ids"], top.indices)
    torch.testing.assert_close(stored["logprobs"], top.values)
    assert stored["offsets"].tolist() == [0] + torch.bincount(row, minlength=5).cumsum(0).tolist()

    student = tiny_model("llama", layers=2, vocab=VOCAB, seed=1)
    method = replay(distill=alpha)
    method.kept, method.stored = {0: [0, 1, 2, 3, 4]}, {0: stored}
    own = rows_with_answers(["b", "b"], seed=3).tensors()
    replayed = earlier.rows([4, 1])
    batch = {key: torch.cat([own[key], replayed[key]]) for key in own}
    got = method.loss(student, {**batch, SLOT: torch.tensor([-1, -1, 4, 1])}, "hf")

    out = student(**batch)
    labelled = (batch["labels"][:, 1:] != -100).sum()
    expected = out.loss
    for r, slot in ((2, 4), (3, 1)):  # each replayed row: KL(q ‖ p) at its stored positions
        start, end = stored["offsets"][slot], stored["offsets"][slot + 1]
        p = out.logits[r, stored["positions"][start:end]].float().log_softmax(-1)
        q = stored["logprobs"][start:end].log_softmax(-1)
        expected = expected + alpha * (q.exp() * (q - p.gather(1, stored["ids"][start:end]))).sum() / labelled
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert method.replayed == 2
    plain = method.loss(student, batch, "hf")  # a caller's own batch: no row is known to be replayed
    torch.testing.assert_close(plain, out.loss)


@pytest.mark.parametrize("options", [dict(distill=1.0), dict(answer_loss="label_space"),
                                     dict(answer_loss="keep_old_labels")])
def test_the_trainer_callback_refuses_a_loss_it_cannot_compute(options):
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    task = adept_ext.prepare(model, get_method(ReplayConfig(base="lora", **options)), general_probe=[], lr=1e-3,
                             total_steps=2, progress=False)
    with pytest.raises(ValueError, match="--replay-distill reads each row's buffer slot, its --answer-loss"):
        MethodCallback(task)


def test_concatenated_blocks_fill_a_tag_that_some_parts_lack_and_refuse_other_gaps():
    tagged = data.TaggedBlocks(rows_with_answers(["a", "b"]), SLOT, np.array([4, 5]))
    plain = rows_with_answers(["c"])
    rows = data.ConcatBlocks([plain, tagged]).rows([1, 0, 2])
    assert rows[SLOT].tolist() == [4, -1, 5]
    assert data.ConcatBlocks([tagged, plain]).rows([2, 0])[SLOT].tolist() == [-1, 4]
    odd = data.TensorBlocks({**plain.tensors(), "position_ids": torch.zeros(1, 12, dtype=torch.long)})
    with pytest.raises(InputError, match="position_ids"):
        data.ConcatBlocks([plain, odd]).rows([0, 1])


def test_the_end_of_a_task_keeps_its_buffer_and_reports_what_it_stored():
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    rows = rows_with_answers(["a", "b", "c"] * 4)
    method = replay(distill=1.0, distill_top_k=3, fraction=0.25, task_index=0)
    method.blocks, report = [rows], {}
    assert method.end_task(model, None, report) is model
    kept = method.kept[0]
    labelled = int((rows.rows(kept)["labels"][:, 1:] != -100).sum())
    # positions and ids int64, log-probabilities float32, offsets int64
    expected = labelled * 8 + labelled * 3 * 8 + labelled * 3 * 4 + (len(kept) + 1) * 8
    assert report["replay"] == {"kept_rows": 3, "replayed_rows": 0, "stored_bytes": expected}


def test_the_label_space_loss_equals_a_direct_computation():
    """The task's own rows: −log softmax over its answers' tokens; a replayed row and a row with a
    target outside the space (general text mixed in): the full cross-entropy; one mean over all."""
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    task = rows_with_answers(["a", "c", "a"], seed=4)
    method = replay(answer_loss="label_space", task_index=0)
    method.kept = {0: [1]}
    method.train_blocks([rows_with_answers(["b"] * 3), task], 1)
    space = method.label_space
    assert space.tolist() == [5, 6, 8, 9]
    own, earlier = task.tensors(), rows_with_answers(["a"] * 3, seed=5).rows([1])  # replayed: in the space, yet full
    batch = {k: torch.cat([own[k], earlier[k]]) for k in own}
    batch["labels"][2, 3] = batch["input_ids"][2, 3] = 30  # a target outside the space: the full loss on that row
    got = method.loss(model, {**batch, SLOT: torch.tensor([-1, -1, -1, 0])}, "hf")

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    total, count = 0.0, 0
    for r in range(4):
        for p in range(batch["labels"].shape[1] - 1):
            target = int(batch["labels"][r, p + 1])
            if target == -100:
                continue
            if r < 2:  # own rows whose every target is in the space: VAG's masking (shaoyijia/VAG,
                # networks/my_bart_model.py: logits outside the label vocabulary set to −inf, then the full CE)
                outside = torch.ones(VOCAB, dtype=torch.bool)
                outside[space] = False
                logp = logits[r, p].masked_fill(outside, -torch.inf).log_softmax(-1)[target]
            else:
                logp = logits[r, p].log_softmax(-1)[target]
            total, count = total - logp, count + 1
    torch.testing.assert_close(got, total / count, rtol=1e-5, atol=1e-6)


def test_the_label_space_is_refused_for_a_text_task_and_options_without_a_buffer():
    ids = torch.arange(5000).reshape(1, 5000)
    text = data.BlockSet(data.TensorBlocks({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}))
    with pytest.raises(InputError, match="task 1's labels use 5000 distinct tokens"):
        replay(answer_loss="label_space", task_index=0).train_blocks([text], 0)
    with pytest.raises(adept_ext.errors.MethodError, match="replay_ratio is taken only with a buffer"):
        ReplayConfig(source="none", ratio=0.5)


def test_no_buffer_trains_the_task_alone():
    method = replay(source="none", task_index=0)
    method.blocks, report = [rows_with_answers(["a"] * 4)], {}
    method.end_task(tiny_model("llama", layers=2, vocab=VOCAB), None, report)
    assert report["replay"] == {"kept_rows": 0, "replayed_rows": 0}
    own = rows_with_answers(["b"] * 5)
    assert method.train_blocks([method.blocks[0], own], 1).tensors()[SLOT].tolist() == [-1] * 5


def test_the_slow_copy_follows_the_ema_and_the_task_ends_with_it():
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    beta = 0.6
    method = get_method(ReplayConfig(ema_decay=beta))
    task = adept_ext.prepare(model, method, general_probe=[], lr=1e-2, total_steps=3, progress=False)
    optimizer = torch.optim.AdamW(task.param_groups, lr=1e-2)
    task.attach(optimizer)
    slow = [p.detach().clone() for p in task.trainable]
    batch = rows_with_answers(["a", "b"]).tensors()
    for t in range(3):  # I-LoRA's update (which47/LLMCL, method/ILORA.py): β_t = min(1 − 1/(t+1), β)
        optimizer.zero_grad()
        task.loss(batch).backward()
        optimizer.step()
        beta_t = min(1 - 1 / (t + 1), beta)
        slow = [beta_t * s + (1 - beta_t) * p.detach() for s, p in zip(slow, task.trainable)]
    trained = [p.detach().clone() for p in task.trainable]
    report = {}
    finished = task.method.end_task(task.model, None, report)
    named = dict(finished.named_parameters())
    names = [n for n, p in task.model.named_parameters() if any(p is q for q in task.trainable)]
    assert len(names) == len(slow) > 0
    for name, expected, fast in zip(names, slow, trained):
        torch.testing.assert_close(named[name].detach(), expected, rtol=1e-6, atol=1e-7)
        assert not torch.equal(expected, fast)  # the slow weights, not the last step's
    assert report["ema"] == {"decay": beta, "bytes": sum(s.numel() * 4 for s in slow)}


def formatted_rows(n, seed=0, width=16, prefix=(11, 12)):
    """Rows "11 12 <body> 13 14 <answer>": a field name (`prefix`), a question of random tokens, an
    instruction, then answer a (5 6) or c (8 9), labelled."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.zeros(n, width, dtype=torch.long), torch.full((n, width), -100)
    mask = torch.zeros(n, width, dtype=torch.long)
    for r in range(n):
        body = torch.randint(15, VOCAB, (3 + r % 3,), generator=g).tolist()
        answer = ANSWERS["a" if r % 2 else "c"]
        row = list(prefix) + body + [13, 14] + answer
        ids[r, :len(row)] = torch.tensor(row)
        labels[r, len(row) - len(answer):len(row)] = torch.tensor(answer)
        mask[r, :len(row)] = 1
    return data.BlockSet(data.TensorBlocks({"input_ids": ids, "attention_mask": mask, "labels": labels}))


@pytest.mark.parametrize("prefix", [(11, 12), ()], ids=["field-name", "input-first"])
def test_generated_pseudo_examples_hold_no_training_row_and_are_answered_by_the_model(prefix):
    """With a shared prefix the model samples after it; without one (the classification tasks: the input
    first, the instruction after it) it samples from its document start, which the rows do not keep."""
    model = tiny_model("llama", layers=2, vocab=VOCAB).train()
    rows = formatted_rows(8, prefix=prefix)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):  # the task learned: the model answers after the instruction
        optimizer.zero_grad()
        model(**rows.tensors()).loss.backward()
        optimizer.step()
    rng_before = torch.random.get_rng_state()
    made = pseudo_examples(model, rows, 6, temperature=1.0, seed=3, progress=False)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the training's RNG untouched
    assert 0 < len(made["input_ids"]) <= 6
    training = {tuple(r) for r in rows.tensors()["input_ids"].tolist()}
    bodies = set()
    for ids, labels, mask in zip(made["input_ids"], made["labels"], made["attention_mask"]):
        row = ids[mask.bool()].tolist()
        assert tuple(ids.tolist()) not in training
        first = int((labels != -100).nonzero()[0])
        prompt, answer = row[:first], row[first:]
        assert prompt[:len(prefix)] == list(prefix) and prompt[-2:] == [13, 14]  # the task's format
        assert len(prompt) > len(prefix) + 2 and 1 not in prompt  # a body, and no document start (BOS 1)
        assert answer[-1] in (6, 9) and labels[first:len(row)].tolist() == answer
        greedy = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=2, pad_token_id=0,
                                eos_token_id=[6, 9])[0, len(prompt):].tolist()
        assert greedy[:len(answer)] == answer  # labelled by the model as it is
        bodies.add(tuple(prompt))
    assert len(bodies) == len(made["input_ids"])  # no duplicate
    again = pseudo_examples(model, rows, 6, temperature=1.0, seed=3, progress=False)
    assert all(torch.equal(again[k], made[k]) for k in made)  # seeded


def test_a_generated_buffer_replays_pseudo_examples_and_survives_a_checkpoint(tmp_path):
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    rows = formatted_rows(8)
    method = replay(source="generated", fraction=0.5, task_index=0)
    method.blocks = [rows]
    made = {"input_ids": torch.full((3, 16), 20), "attention_mask": torch.ones(3, 16, dtype=torch.long),
            "labels": torch.full((3, 16), 5)}
    import adept_ext.methods.replay as replay_module
    replay_module_pseudo = replay_module.pseudo_examples
    try:
        replay_module.pseudo_examples = lambda *args: made
        report = {}
        method.end_task(model, None, report)
    finally:
        replay_module.pseudo_examples = replay_module_pseudo
    assert report["replay"]["generated_rows"] == 3 and report["replay"]["kept_rows"] == 3
    torch.save(method.state_dict(), tmp_path / "state.pt")
    restored = replay(source="generated", fraction=0.5)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    mixed = restored.train_blocks([rows, formatted_rows(4, seed=1)], 1).tensors()
    assert torch.equal(mixed["input_ids"][mixed[SLOT] >= 0], made["input_ids"])  # the pseudo rows, not the task's


def test_generated_replay_is_refused_for_a_text_task():
    ids = torch.arange(24).reshape(2, 12) + 10
    text = data.BlockSet(data.TensorBlocks({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}))
    with pytest.raises(InputError, match="a text task"):
        pseudo_examples(tiny_model("llama", layers=2, vocab=VOCAB), text, 2, 1.0, 0, progress=False)


def test_the_memory_check_counts_the_slow_copy():
    params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(7))]
    assert replay(ema_decay=0.9).extra_bytes(params) == 22 * 4 and replay().extra_bytes(params) == 0
    from adept_ext.continual import config_from
    from adept_ext.training import device as device_module
    model, cfg = tiny_model("llama", layers=2, vocab=VOCAB), config_from({"method": "replay"})
    plain = device_module.memory_estimate(cfg, model, trainable=22, device=torch.device("cpu"))
    counted = device_module.memory_estimate(cfg, model, trainable=22, device=torch.device("cpu"), method_bytes=88)
    assert counted["optimizer"] == plain["optimizer"] + 88


def test_with_every_token_stored_the_distillation_is_seekrs_soft_target_loss_less_a_constant():
    """SEEKR (jinghan1he/SEEKR, training/seekr.py) stores the teacher's full logits and takes
    CrossEntropyLoss(student logits, softmax(teacher logits)) averaged over the answer tokens: with
    k = V our KL(q ‖ p) summed is that loss times the tokens, less the teacher's entropy (a constant)."""
    teacher, student = tiny_model("llama", layers=2, vocab=VOCAB), tiny_model("llama", layers=2, vocab=VOCAB, seed=1)
    rows = rows_with_answers(["a", "c", "b"], seed=6)
    method = replay(distill=1.0)
    method.kept, method.stored = {0: [0, 1, 2]}, {0: top_k_log_probs(teacher, rows, VOCAB)}
    batch = rows.tensors()
    with final_hidden(student) as caught:
        student_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ours = method.distill_sum(student, caught[-1], torch.tensor([0, 1, 2]))
    with torch.no_grad():
        row, position, teacher_logp = labelled_log_probs(teacher, batch)
    seekr = torch.nn.CrossEntropyLoss()(student_logits[row, position], teacher_logp.exp())
    entropy = -(teacher_logp.exp() * teacher_logp).sum(-1).mean()
    torch.testing.assert_close(ours / len(row), seekr - entropy, rtol=1e-5, atol=1e-6)


def test_keeping_old_labels_out_of_the_softmax_equals_a_direct_computation():
    """A task's own positions: −log softmax over the vocabulary less the earlier tasks' answer tokens
    that are not its own; positions whose target is such a token, and replayed rows: the full loss."""
    model = tiny_model("llama", layers=2, vocab=VOCAB)
    earlier, task = rows_with_answers(["a", "b"], seed=7), rows_with_answers(["c", "a", "c"], seed=4)
    method = replay(answer_loss="keep_old_labels")
    method.kept = {0: [0]}
    method.train_blocks([earlier, task], 1)
    assert method.old_labels.tolist() == [7]  # b's token; a's are this task's too
    own = task.tensors()
    batch = {k: torch.cat([own[k], earlier.rows([0])[k]]) for k in own}
    batch["labels"][1, 3] = batch["input_ids"][1, 3] = 7  # an old label as a target of an own row: the full loss
    got = method.loss(model, {**batch, SLOT: torch.tensor([-1, -1, -1, 0])}, "hf")

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    total, count = 0.0, 0
    for r in range(4):
        for p in range(batch["labels"].shape[1] - 1):
            target = int(batch["labels"][r, p + 1])
            if target == -100:
                continue
            row = logits[r, p].clone()
            if r < 3 and target != 7:
                row[7] = -torch.inf
            total, count = total - row.log_softmax(-1)[target], count + 1
    torch.testing.assert_close(got, total / count, rtol=1e-5, atol=1e-6)
    first = replay(answer_loss="keep_old_labels", task_index=0)
    first.train_blocks([task], 0)
    torch.testing.assert_close(first.loss(model, batch, "hf"), model(**batch).loss)  # no earlier task: the token loss


def test_label_replay_adds_each_earlier_answer_as_a_pseudo_example():
    earlier = formatted_rows(8)
    labels = label_examples(earlier)
    rows = [(ids[mask.bool()].tolist(), lab[lab != -100].tolist())
            for ids, mask, lab in zip(labels["input_ids"], labels["attention_mask"], labels["labels"])]
    assert rows == [([11, 12, 5, 13, 14, 5, 6], [5, 6]), ([11, 12, 8, 13, 14, 8, 9], [8, 9])]
    method = replay(source="none", label_replay=True, ratio=0.5, task_index=0)
    method.blocks = [earlier]
    report = {}
    method.end_task(tiny_model("llama", layers=2, vocab=VOCAB), None, report)
    assert report["replay"] == {"kept_rows": 0, "replayed_rows": 0, "label_rows": 2}
    mixed = method.train_blocks([earlier, formatted_rows(6, seed=1)], 1).tensors()
    assert (mixed[SLOT] >= 0).sum() == 6 and (mixed[SLOT] < 0).sum() == 6  # half of every batch: the answers' rows
    assert all(any(torch.equal(r, k) for k in labels["input_ids"]) for r in mixed["input_ids"][mixed[SLOT] >= 0])


def test_label_replay_and_generated_replay_refuse_a_text_task_before_it_trains():
    ids = torch.arange(24).reshape(2, 12) + 10
    text = data.BlockSet(data.TensorBlocks({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}))
    for options in (dict(label_replay=True), dict(source="generated")):
        with pytest.raises(InputError, match="a text task"):
            replay(task_index=0, **options).train_blocks([text], 0)
