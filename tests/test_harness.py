"""lm-evaluation-harness in-process (adept_ext.evaluation.harness): scores checked against the same log-likelihoods and
greedy answers computed with the model directly, on local offline tasks; the caller's random states and
module modes kept; one clear error before anything loads; the eval and run commands' reports."""
import json
import random

import numpy as np
import pytest
import torch
import ranks
from tiny_models import write_run_workspace

from adept_ext.evaluation import harness
from adept_ext.errors import RunError
from adept_ext.evaluation.paired import paired_difference

pytest.importorskip("lm_eval")

MC = [("The sky is", ["blue", "green", "loud"]), ("Two plus two is", ["three", "four", "five"]),
      ("Fire is", ["cold", "wet", "hot"]), ("Grass is", ["green", "red", "purple", "grey"])]
GEN = ["Say yes:", "Count: one two", "The capital of France is"]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("harness"))


@pytest.fixture(scope="module")
def tiny(workspace):
    from adept_ext.models import load_model

    return load_model(str(workspace / "tiny"))


def mc_prompt(question):
    return f"Question: {question}\nAnswer:"


@torch.no_grad()
def loglikelihood(model, tokenizer, context, continuation):
    """log p(continuation | context), summed over its tokens, as lm-eval splits the pair: the tokens of
    context + continuation after those of the context alone."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    logp = model(torch.tensor([whole[:-1]])).logits.float().log_softmax(-1)[0]
    return sum(logp[i - 1, whole[i]].item() for i in range(n_context, len(whole)))


@torch.no_grad()
def greedy(model, tokenizer, prompt):
    """The model's greedy continuation of `prompt` (NEW_TOKENS tokens), cut at the first newline."""
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    start = len(ids)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tokenizer.decode(ids[start:]).split("\n")[0]


def write_tasks(root, model, tokenizer):
    """A multiple-choice and a generation task over local JSONL files (lm-eval's YAML format) whose right
    answers are chosen so that the expected scores are known: the model's own choice (the argmax of
    the choices' summed log-probabilities) is the answer of the first two questions and not of the last
    two (accuracy 1/2); its greedy answer is the target of the first two prompts and not of the third
    (exact match 2/3). Returns the folder and the direct log-likelihoods."""
    was = model.training
    model.eval()
    lls = [[loglikelihood(model, tokenizer, mc_prompt(q), " " + c) for c in choices] for q, choices in MC]
    answers = [greedy(model, tokenizer, p) for p in GEN]
    model.train(was)
    picks = [int(np.argmax(row)) for row in lls]
    gold = [picks[0], picks[1], (picks[2] + 1) % 3, (picks[3] + 1) % 4]
    folder = root / "tasks"
    folder.mkdir(exist_ok=True)
    (root / "mc.jsonl").write_text("\n".join(json.dumps({"question": q, "choices": c, "answer": g})
                                             for (q, c), g in zip(MC, gold)))
    (root / "gen.jsonl").write_text("\n".join(json.dumps({"question": p, "answer": a})
                                              for p, a in zip(GEN, [answers[0], answers[1], answers[2] + "!"])))
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files: {root / 'mc.jsonl'}
test_split: train
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files: {root / 'gen.jsonl'}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {NEW_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder, lls


def expanded(model):
    from adept_ext.adept.expand import expand_layers

    expand_layers(model, [1])
    with torch.no_grad():  # the copy starts as an identity (FPI): move it so that it counts
        for p in model.model.layers[2].mlp.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


@pytest.mark.parametrize("variant", ["plain", "expanded", "lora"])
def test_scores_equal_a_direct_computation(workspace, tmp_path, variant):
    """Accuracy, exact match, their stderr and item counts as computed by hand from the model's own
    log-likelihoods and greedy answers: a plain model, an ADEPT-expanded one, and a LoRA model before
    merging (PEFT's wrapper, adapters not zero)."""
    from adept_ext.models import load_model

    model, tokenizer = load_model(str(workspace / "tiny"))
    model = {"plain": lambda m: m, "expanded": expanded, "lora": with_lora}[variant](model)
    folder, lls = write_tasks(tmp_path, model, tokenizer)
    scores = harness.evaluate_benchmarks(model, tokenizer, ["tiny_mc", "tiny_gen"], str(folder), batch_size=2,
                                         samples_path=tmp_path / "samples.jsonl")
    mc, gen = scores["tasks"]["tiny_mc"], scores["tasks"]["tiny_gen"]
    assert (mc["n"], mc["n_total"], gen["n"], gen["n_total"]) == (4, 4, 3, 3)
    assert mc["metrics"]["acc"]["value"] == 0.5
    assert mc["metrics"]["acc"]["stderr"] == pytest.approx(np.std([1, 1, 0, 0], ddof=1) / 2)
    assert gen["metrics"]["exact_match"]["value"] == pytest.approx(2 / 3)
    # Each item's score, in doc order, for the paired tests: the first two right, as written.
    assert scores["items"]["tiny_mc"] == {"doc_ids": [0, 1, 2, 3], "metrics": {"acc": [1.0, 1.0, 0.0, 0.0]}}
    assert scores["items"]["tiny_gen"] == {"doc_ids": [0, 1, 2], "metrics": {"exact_match": [1.0, 1.0, 0.0]}}
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    logged = [[r[0] for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])
              if s["task"] == "tiny_mc"]
    assert [len(row) for row in logged] == [len(row) for row in lls]
    assert np.allclose(sum(logged, []), sum(lls, []), atol=1e-3)
    json.dumps(scores, allow_nan=False)  # plain JSON


def test_the_callers_random_state_and_module_modes_are_kept(tiny, tmp_path):
    """lm-eval reseeds Python, numpy and torch with its own seeds: after the call the caller's generators
    draw what they would have drawn without it, and every module is in the mode it was (a model in
    training, one layer in eval mode). lm-eval's own seeds are kept: its few-shot draw does not depend
    on the caller's state."""
    model, tokenizer = tiny
    folder, _ = write_tasks(tmp_path, model, tokenizer)
    model.train()
    model.model.layers[0].eval()
    modes = {name: m.training for name, m in model.named_modules()}

    def draws():
        return random.random(), np.random.rand(), torch.rand(3).tolist()

    def seed(s):
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)

    seed(1)
    expected = draws()
    seed(1)
    first = harness.evaluate_benchmarks(model, tokenizer, ["tiny_mc"], str(folder), num_fewshot=2)
    assert draws() == expected
    assert {name: m.training for name, m in model.named_modules()} == modes
    seed(2)
    second = harness.evaluate_benchmarks(model, tokenizer, ["tiny_mc"], str(folder), num_fewshot=2)
    assert second["tasks"] == first["tasks"] and first["tasks"]["tiny_mc"]["num_fewshot"] == 2


def test_chat_template_and_multiturn_fewshot_reach_the_prompts(tiny, tmp_path):
    """--apply-chat-template renders each item with the tokenizer's template (SmolLM2's ChatML), and
    --fewshot-as-multiturn puts each few-shot example in turns of its own."""
    model, tokenizer = tiny
    folder, _ = write_tasks(tmp_path, model, tokenizer)

    def prompt(**kwargs):
        harness.evaluate_benchmarks(model, tokenizer, ["tiny_mc"], str(folder), num_fewshot=1, limit=1,
                                    samples_path=tmp_path / "s.jsonl", **kwargs)
        return json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])["arguments"][0][0]

    assert "<|im_start|>" not in prompt()
    single = prompt(apply_chat_template=True)
    multi = prompt(apply_chat_template=True, fewshot_as_multiturn=True)
    assert single.count("<|im_start|>user") == 1 and multi.count("<|im_start|>user") == 2


def test_bad_benchmark_options_are_one_error_before_anything_loads(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text("task: local\ndataset_path: json\noutput_type: multiple_choice\n")
    cases = [(dict(limit=0), "limit must be >= 1"), (dict(limit=-2), "limit must be >= 1"),
             (dict(num_fewshot=-2), "num_fewshot must be >= 0"),
             (dict(fewshot_as_multiturn=True), "needs --apply-chat-template"),
             (dict(include_path=str(tmp_path / "empty")), "no YAML task file"),
             (dict(include_path=str(tmp_path / "missing")), "no such folder")]
    for kwargs, error in cases:
        with pytest.raises(RunError, match=error):
            harness.check_benchmarks(["local"], **kwargs)
    # the folder's own tasks alone: lm-eval's built-in tasks are not indexed
    assert harness.task_manager(("local",), str(tmp_path / "tasks")).all_tasks == ["local"]
    with pytest.raises(RunError, match="unknown task 'hellaswagg'.*did you mean 'hellaswag'"):
        harness.check_benchmarks(["hellaswagg"], str(tmp_path / "tasks"))


def test_a_task_folder_whose_yaml_runs_python_is_named_in_a_warning(tmp_path, caplog):
    """lm-eval imports and runs the Python file a `!function` tag names: the user is told which files do."""
    (tmp_path / "plain.yaml").write_text("task: plain\ndataset_path: json\noutput_type: multiple_choice\n")
    harness.check_benchmarks([], str(tmp_path))
    assert "!function" not in caplog.text
    (tmp_path / "coded.yaml").write_text("task: coded\ndataset_path: json\nprocess_docs: !function utils.process\n")
    harness.check_benchmarks([], str(tmp_path))
    assert "coded.yaml name Python functions (!function)" in caplog.text and "plain.yaml" not in caplog.text


def test_eval_command_writes_the_scores(workspace, tiny, tmp_path):
    from adept_ext.cli import main

    folder, _ = write_tasks(tmp_path, *tiny)
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(workspace / "tiny"), "--general", str(workspace / "general"), "--domain",
            str(workspace / "domain.jsonl"), "--max-length", "32", "--eval-blocks", "2", "--out", str(out),
            "--benchmarks", "tiny_mc,tiny_gen", "--include-path", str(folder), "--limit", "2", "--log-samples",
            "--no-progress"]
    assert main(argv) == 0
    result = json.loads((out / "eval.json").read_text())
    tasks = result["benchmarks"]["tasks"]
    assert (tasks["tiny_mc"]["n"], tasks["tiny_mc"]["n_total"], tasks["tiny_gen"]["n"]) == (2, 4, 2)
    assert tasks["tiny_mc"]["metrics"]["acc"]["value"] == 1.0  # the first two questions: the model's own picks
    assert "| tiny_mc | acc | 1.0000 |" in (out / "eval.md").read_text()
    assert len((out / "benchmark_samples.jsonl").read_text().splitlines()) == 4


def _train_options(workspace, out, **kw):
    from adept_ext.train import config_from

    return config_from(dict(model=str(workspace / "tiny"), general=str(workspace / "general"),
                            domain=str(workspace / "domain.jsonl"), out=str(out), method="lora", lora_rank=2,
                            max_length=32, batch_size=2, steps=4, warmup_steps=1, probe_blocks=2, eval_blocks=2,
                            eval_every=0, save_every=2, lr=1e-3, **kw))


def scored(acc, doc_ids=None):
    """An `evaluate_benchmarks` result of one task with per-item accuracies `acc`."""
    mean = float(np.mean(acc))
    stderr = float(np.std(acc, ddof=1) / np.sqrt(len(acc)))
    return {"tasks": {"t": {"n": len(acc), "metrics": {"acc": {"value": mean, "stderr": stderr}}}},
            "items": {"t": {"doc_ids": doc_ids or list(range(len(acc))), "metrics": {"acc": acc}}}}


def test_compare_pairs_each_items_base_and_final_scores():
    """`compare`: the independent-samples rule beside McNemar's test on the same items (base first), in
    report tables; no paired verdict where the items differ or were not kept."""
    base, final = [1.0] * 20 + [0.0] * 5 + [1.0] * 100 + [0.0] * 75, [0.0] * 20 + [1.0] * 5 + [1.0] * 100 + [0.0] * 75
    got = harness.compare(scored(base), scored(final))["t"]["acc"]
    assert got["delta"] == pytest.approx(-0.075) and got["beyond_2se"] is False
    assert got["paired"] == paired_difference(base, final)
    assert (got["paired"]["base_only"], got["paired"]["final_only"], got["paired"]["significant"]) == (20, 5, True)
    table = harness.comparison_table({"t": {"acc": got}})
    assert "| t | acc | 0.6000 | 0.5250 | -0.0750 |" in table and f"| {got['paired']['p_value']:.3g} |" in table
    lo, hi = got["paired"]["interval"]
    assert table.rstrip().endswith(f"| no | {got['paired']['p_value']:.3g} | [{lo:+.4f}, {hi:+.4f}] | yes |")
    shuffled = scored(final, doc_ids=list(range(1, 201)))
    assert harness.compare(scored(base), shuffled)["t"]["acc"]["paired"] is None
    assert harness.compare({"tasks": scored(base)["tasks"]}, scored(final))["t"]["acc"]["paired"] is None


def test_run_with_benchmarks_trains_as_without_and_resumes_to_the_same_report(workspace, tiny, tmp_path,
                                                                             monkeypatch):
    """`run --benchmarks`: base and final scores with their difference in report.json, report.md and
    TensorBoard; the training is the one without benchmarks (same losses: the random states are kept,
    LoRA's initialisation draws after the base evaluation); a run killed after its first checkpoint and
    resumed writes the report of an uninterrupted one."""
    import adept_ext.train as train_module
    from adept_ext.train import run

    folder, _ = write_tasks(tmp_path, *tiny)
    bench = dict(benchmarks="tiny_mc", include_path=str(folder))
    quiet = dict(progress=False, log=lambda *a: None)
    plain = run(_train_options(workspace, tmp_path / "plain"), **quiet)
    with_bench = run(_train_options(workspace, tmp_path / "bench", report_to="tensorboard", **bench), **quiet)
    assert [h["loss"] for h in with_bench["history"]["train"]] == [h["loss"] for h in plain["history"]["train"]]
    diff = with_bench["benchmarks"]["difference"]["tiny_mc"]["acc"]
    assert diff["base"] == 0.5 and diff["delta"] == pytest.approx(diff["final"] - 0.5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "bench" / "runs"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("benchmarks/tiny_mc/acc")] == [(0, 0.5), (4, diff["final"])]
    assert "| tiny_mc | acc | 0.5000 |" in (tmp_path / "bench" / "report.md").read_text()
    base_items = with_bench["benchmarks"]["base"]["items"]["tiny_mc"]["metrics"]["acc"]
    final_items = with_bench["benchmarks"]["final"]["items"]["tiny_mc"]["metrics"]["acc"]
    assert base_items == [1.0, 1.0, 0.0, 0.0]
    assert diff["paired"] == paired_difference(base_items, final_items)
    assert "McNemar p" in (tmp_path / "bench" / "report.md").read_text()

    real = train_module.fit_task

    def killed_after_the_first_checkpoint(*args, hooks, **kwargs):
        after_step = hooks.after_step

        def stop(step):
            after_step(step)
            if step == 3:
                raise KeyboardInterrupt

        hooks.after_step = stop
        return real(*args, hooks=hooks, **kwargs)

    monkeypatch.setattr(train_module, "fit_task", killed_after_the_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        run(_train_options(workspace, tmp_path / "resumed", **bench), **quiet)
    monkeypatch.setattr(train_module, "fit_task", real)
    resumed = run(_train_options(workspace, tmp_path / "resumed", resume=True, **bench), **quiet)
    assert [h["loss"] for h in resumed["history"]["train"]] == [h["loss"] for h in with_bench["history"]["train"]]
    for key in ("base", "final"):
        assert resumed["benchmarks"][key]["tasks"] == with_bench["benchmarks"][key]["tasks"]


def test_continual_scores_the_base_model_and_every_nth_task(tmp_path, tiny):
    """`continual --benchmarks --benchmarks-every 2` on three tasks: the base model, the second and the last
    task's rows carry the scores, the first's not; report.md shows them beside the score matrix with the
    base-vs-last table; the score matrix is the one without benchmarks (the random states are kept)."""
    from tiny_models import write_sequence_workspace

    from adept_ext.continual import config_from, run

    ws = write_sequence_workspace(tmp_path / "ws")
    folder, _ = write_tasks(tmp_path, *tiny)
    base = dict(model=str(ws / "tiny"), tasks=f"{ws / 'docs.txt'},{ws / 'topics.jsonl'},{ws / 'domain.jsonl'}",
                general=str(ws / "general"), method="seq_lora", lora_rank=2, max_length=32, batch_size=2, steps=2,
                warmup_steps=1, probe_blocks=2, eval_blocks=3, save_every=0, lr=1e-3)
    quiet = dict(progress=False, log=lambda *a: None)
    plain = run(config_from({**base, "out": str(tmp_path / "plain")}), **quiet)
    scored = run(config_from({**base, "out": str(tmp_path / "scored"), "benchmarks": "tiny_mc",
                              "include_path": str(folder), "benchmarks_every": 2}), **quiet)
    assert scored["matrix"] == plain["matrix"]
    assert ["benchmarks" in row for row in scored["rows"]] == [True, False, True, True]
    assert scored["rows"][0]["benchmarks"]["tasks"]["tiny_mc"]["metrics"]["acc"]["value"] == 0.5
    assert scored["benchmark_difference"]["tiny_mc"]["acc"]["base"] == 0.5
    text = (tmp_path / "scored" / "report.md").read_text()
    assert "| base | 0.5000 ± 0.2887 |" in text and "Base model vs after the last task" in text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, world, port, model_dir, folder, result_file):
    import os

    import torch.distributed as dist

    from adept_ext.models import load_model

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    try:
        model, tokenizer = load_model(model_dir)
        scores = harness.evaluate_benchmarks(model, tokenizer, ["tiny_mc"], folder,
                                             samples_path=f"{result_file}.samples.{rank}")
        torch.save(scores, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_evaluate_once_on_rank_0(workspace, tiny, tmp_path):
    """Rank 0 evaluates, rank 1 waits and receives the same result (to the timing, which two evaluations
    would not share); only rank 0 writes the samples."""
    folder, _ = write_tasks(tmp_path, *tiny)
    ranks.spawn(_rank_worker, args=(2, _free_port(), str(workspace / "tiny"), str(folder), str(tmp_path / "r")),
             nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r.{r}") for r in (0, 1))
    assert r0 == r1 and r0["tasks"]["tiny_mc"]["metrics"]["acc"]["value"] == 0.5
    assert (tmp_path / "r.samples.0").exists() and not (tmp_path / "r.samples.1").exists()


def _run_rank_worker(rank, world, port, options, result_file):
    import os

    from adept_ext.train import config_from, run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    report = run(config_from(options), progress=False, log=lambda *a: None)
    torch.save(report["benchmarks"], f"{result_file}.{rank}")


def test_run_on_two_gloo_ranks_evaluates_once_and_both_report_it(workspace, tiny, tmp_path):
    """`run --benchmarks` under 2 gloo ranks (DDP): both ranks return rank 0's scores (the timings too,
    which two evaluations would not share), and rank 0 writes them into report.json."""
    folder, _ = write_tasks(tmp_path, *tiny)
    options = dict(model=str(workspace / "tiny"), general=str(workspace / "general"),
                   domain=str(workspace / "domain.jsonl"), out=str(tmp_path / "ddp"), method="lora", lora_rank=2,
                   max_length=32, batch_size=2, steps=2, warmup_steps=1, probe_blocks=2, eval_blocks=2, eval_every=0,
                   save_every=0, lr=1e-3, benchmarks="tiny_mc", include_path=str(folder), log_samples=True)
    ranks.spawn(_run_rank_worker, args=(2, _free_port(), options, str(tmp_path / "r")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r.{r}") for r in (0, 1))
    assert r0 == r1 and r0["base"]["tasks"]["tiny_mc"]["metrics"]["acc"]["value"] == 0.5
    assert json.loads((tmp_path / "ddp" / "report.json").read_text())["benchmarks"] == r0
    assert len((tmp_path / "ddp" / "benchmark_samples_final.jsonl").read_text().splitlines()) == 4
