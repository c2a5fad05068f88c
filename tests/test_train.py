"""The main job end to end on a tiny real model with the SmolLM2 tokenizer and real text."""
import json
import re

import pytest
import torch
from tiny_models import write_run_workspace
from transformers import AutoConfig, AutoModelForCausalLM

from adept_ext.cli import main
from adept_ext.errors import RunError
from adept_ext.train import METHODS, config_from, run
from adept_ext.training import read_checkpoint


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("run"))


def options(ws, out, **kw):
    base = dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"), out=str(ws / out),
                k=2, max_length=32, batch_size=2, steps=4, warmup_steps=1, probe_blocks=4, eval_blocks=4, eval_every=2,
                save_every=2, recompute_every=2, lr=1e-3)
    base.update(kw)
    return config_from(base)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_and_saves_a_plain_hf_model(workspace, monkeypatch, method):
    """The run's files and saved model, and what each method does (a method that trains nothing, or
    whose own part does nothing, fails): every trainable tensor moves and nothing else does, the
    held-out domain loss falls, and per method its own effect (what trains: every parameter, the
    copies, the shallow half, the chosen layers, the adapted projections; per-unit rates or one rate)."""
    from method_spy import TaskSpy, changed_tensors  # the test's own helpers (tests/method_spy.py)

    spy = TaskSpy(monkeypatch)
    report = run(options(workspace, f"out-{method}", method=method), progress=False, log=lambda *a: None)
    out = workspace / f"out-{method}"
    assert (out / "report.json").exists() and (out / "report.md").exists() and (out / "loss_curves.png").exists()
    assert not (out / "checkpoint.pt").exists()
    assert (out / "report.json").stat().st_mode & 0o044 and (out / "model").stat().st_mode & 0o055  # umask 022
    saved = json.loads((out / "report.json").read_text())
    assert saved["method"] == method and 0 < saved["trainable_fraction"] <= 1
    estimate = saved["memory_estimate_mb"]  # the check's estimate for what trained: 12 + 4 bytes a parameter
    assert estimate["optimizer"] == round(16 * saved["trainable_parameters"] / 2**20) and estimate["total"] > 0
    assert f"estimate for the steps: {estimate['total']} MB" in (out / "report.md").read_text()
    assert saved["final"]["domain_loss"] < saved["base"]["domain_loss"], "the held-out domain loss did not fall"
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    expect_layers = 6 if method in ("adept", "llama_pro", "adept_uniform_lr") else 4
    assert model.config.num_hidden_layers == expect_layers
    (record,) = spy.tasks
    assert not record.unchanged(), f"trainable {[record.names[i] for i in record.unchanged()]} did not move"
    assert not record.frozen_changed, f"frozen {record.frozen_changed} changed"
    assert record.step_lrs
    per_unit = [len(set(lrs)) > 1 for lrs in record.step_lrs]  # the groups stepped at different rates
    if method in ("adept", "adept_no_expand"):
        assert all(per_unit), record.step_lrs
        assert len(set(report["unit_rates"]["multipliers"].values())) > 1
    else:
        assert not any(per_unit), record.step_lrs
    if method == "full":
        assert not record.frozen, sorted(record.frozen)[:3]
    if method in ("adept", "llama_pro", "adept_uniform_lr"):  # the copies train, nothing else
        assert record.layers() == model.config.adept["expanded_layers"], record.names
        assert len(record.names) == len(record.before)
    if method in ("freeze_deep", "adept_no_expand"):  # the shallow half / the chosen layers, nothing else
        assert record.layers() == report["layers"] == ([0, 1] if method == "freeze_deep" else record.layers())
        assert len(record.names) == len(record.before) and all(n.startswith("model.layers.") for n in record.names)
        changed = changed_tensors(model, base)
        assert changed and {int(n.split(".")[2]) for n in changed} == set(report["layers"]), changed
    if method == "lora":  # merged: only the adapted projections moved
        changed = changed_tensors(model, base)
        assert changed and all(n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj") for n in changed), changed
    if method == "adept":
        assert (out / "unit_rates.png").exists() and (out / "layer_importance.png").exists()
        assert model.config.adept["expanded_layers"] == [l + 1 + i for i, l in enumerate(report["layers"])]
        # one numbering everywhere a person reads layer numbers: the model's before expansion
        assert model.config.adept["source_layers_before_expansion"] == report["layers"]
        assert json.loads((out / "layer_importance.json").read_text())["selected"] == report["layers"]
        assert f"copies of layers {report['layers']}" in (out / "report.md").read_text()
    if method == "lora":
        assert not any("lora" in n for n, _ in model.named_parameters())


def test_adept_keeps_original_weights_frozen(workspace):
    run(options(workspace, "frozen"), progress=False, log=lambda *a: None)
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    expanded = AutoModelForCausalLM.from_pretrained(workspace / "frozen" / "model")
    layers = expanded.config.adept["expanded_layers"]
    originals = [l for i, l in enumerate(expanded.model.layers) if i not in layers]
    for a, b in zip(base.model.layers, originals):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


FROZEN_BF16 = {"bf16": "on", "frozen_dtype": "bfloat16"}


@pytest.mark.parametrize("method,streaming,extra", [("adept", False, {}), ("adept_uniform_lr", False, {}),
                                                    ("full", False, {}), ("full", True, {}),
                                                    ("full", True, {"dataloader_num_workers": 1}),
                                                    ("adept", False, FROZEN_BF16)])
def test_resume_after_interrupt_gives_the_same_result(workspace, monkeypatch, method, streaming, extra):
    """Also with --streaming (the resumed run reads the stream from the start up to its step; also in
    a loader worker) and with the frozen weights in bfloat16 (they are cast again when the task is
    prepared anew). With loader workers: tests/test_dataloader.py."""
    run_name = method + ("-streaming" if streaming else "") + "".join(f"-{k}" for k in extra)
    full, resumed, _ = killed_and_resumed(workspace, monkeypatch, run_name, method=method, streaming=streaming,
                                          **extra)
    assert resumed["final"]["domain_loss"] == pytest.approx(full["final"]["domain_loss"], rel=1e-5)
    assert resumed["final"]["general_loss"] == pytest.approx(full["final"]["general_loss"], rel=1e-5)
    assert resumed["drift"] == pytest.approx(full["drift"], rel=1e-4)  # the base's distributions in the checkpoint
    assert [h["loss"] for h in resumed["history"]["train"]] == pytest.approx(
        [h["loss"] for h in full["history"]["train"]], rel=1e-5)


def killed_and_resumed(workspace, monkeypatch, run_name, **kw):
    """The reports of a 6-step run and of the same run killed (Ctrl-C) at its first evaluation inside
    the task (step 3), after the in-task checkpoint, then resumed; and that checkpoint."""
    full = run(options(workspace, f"uninterrupted-{run_name}", steps=6, eval_every=3, **kw),
               progress=False, log=lambda *a: None)
    import adept_ext.training.one_domain as one_domain

    real_evaluate = one_domain.evaluate

    def interrupting(model, batches, device, desc, *args, **kwargs):
        if desc == "eval general":  # the first evaluation inside the task: base evaluations are labelled
            raise KeyboardInterrupt
        return real_evaluate(model, batches, device, desc, *args, **kwargs)

    monkeypatch.setattr(one_domain, "evaluate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(options(workspace, f"killed-{run_name}", steps=6, eval_every=3, **kw), progress=False,
            log=lambda *a: None)
    checkpoint = read_checkpoint(workspace / f"killed-{run_name}")
    monkeypatch.setattr(one_domain, "evaluate", real_evaluate)
    resumed = run(options(workspace, f"killed-{run_name}", steps=6, eval_every=3, resume=True, **kw),
                  progress=False, log=lambda *a: None)
    return full, resumed, checkpoint


def test_cli_run_with_toml_config_and_flag_override(workspace, tmp_path, capsys):
    from dataclasses import fields

    cfg = tmp_path / "run.toml"
    opts = options(workspace, "cli")
    runner_options = [f.name for f in fields(opts) if "methods" not in f.metadata]  # not a method's own
    cfg.write_text("\n".join(f"{k} = {json.dumps(getattr(opts, k))}" for k in runner_options
                             if k not in ("resume", "overwrite")))
    with_k = tmp_path / "k.toml"
    with_k.write_text(cfg.read_text() + "\nk = 2\n")
    assert main(["run", "--config", str(with_k), "--method", "freeze_deep", "--no-progress"]) == 2
    assert "--k is an option of adept, llama_pro" in capsys.readouterr().err  # given in the file: refused
    assert not (workspace / "cli").exists()
    assert main(["run", "--config", str(cfg), "--method", "freeze_deep", "--no-progress"]) == 0
    report = json.loads((workspace / "cli" / "report.json").read_text())
    assert report["method"] == "freeze_deep" and report["config"]["max_length"] == 32
    assert main(["run", "--config", str(cfg), "--no-progress"]) == 2
    assert "holds a finished run of `adept-ext run`" in capsys.readouterr().err


def test_block_len_is_the_former_name_of_max_length(workspace, tmp_path, capsys):
    """--block-len, a TOML `block_len` and an older run.json's key all set max_length; both at once are refused."""
    from adept_ext.cli import build_parser, resolve_config
    from adept_ext.training.rundir import TOOL

    assert config_from({"block_len": 48}).max_length == 48
    with pytest.raises(RunError, match="block_len and max_length are one option"):
        config_from({"block_len": 48, "max_length": 64})
    toml = tmp_path / "old.toml"
    toml.write_text("block_len = 40\n")
    args = build_parser().parse_args(["run", "--config", str(toml), "--out", str(tmp_path / "o")])
    assert resolve_config(args).max_length == 40
    assert build_parser().parse_args(["run", "--block-len", "24"]).max_length == 24
    run_json = {"tool": TOOL, "command": "run", "config": {**vars(options(workspace, "old")), "resume": False}}
    run_json["config"]["block_len"] = run_json["config"].pop("max_length")  # as an older version wrote it
    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / "run.json").write_text(json.dumps(run_json))
    args = build_parser().parse_args(["run", "--out", str(tmp_path / "old-run"), "--resume"])
    assert resolve_config(args).max_length == 32


@pytest.mark.parametrize("argv,message", [
    (["run", "--model", "no-such-model"], "neither an embedded model"),
    (["run", "--method", "magic"], "unknown method"),
    (["run", "--steps", "0"], "steps must be >= 1"),
    (["run", "--config", "/nonexistent.toml"], "no such file"),
    (["run", "--k", "99"], "not in [1, 4]"),
    (["run", "--batch-size", "100000000"], "lower --batch-size"),
    (["run", "--layers", "1,7"], "--layers [7] out of range"),
    (["run", "--layers", "1;2"], "comma-separated layer indices"),
    (["run", "--method", "full", "--layers", "1"], "--layers is an option of adept, llama_pro"),
    (["run", "--method", "freeze_deep", "--boundary", "4"], "boundary 4 is not in [1, 3]"),
    (["run", "--method", "freeze_deep", "--boundary", "deep"], "boundary must be half, auto"),
    (["diagnose", "--diagnosis-task", "poetry"], "diagnosis_task must be one of"),
    (["run", "--placement", "nearest"], "placement must be one of"),
    (["run", "--method", "llama_pro", "--placement", "spread"], "--placement is an option of adept,"),
])
def test_cli_errors_are_one_line_and_exit_2(workspace, tmp_path, capsys, argv, message):
    argv = argv + ["--out", str(tmp_path / "o"), "--no-progress"]
    if "--model" not in argv:
        argv += ["--model", str(workspace / "tiny"), "--general", str(workspace / "general"),
                 "--domain", str(workspace / "domain.jsonl"), "--block-len", "32"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0] and errors[0].startswith("adept-ext: error: ")


@pytest.mark.parametrize("method", ["adept", "llama_pro"])
def test_explicit_layers_override_the_methods_choice(workspace, method):
    report = run(options(workspace, f"layers-{method}", method=method, layers="3,0", steps=1),
                 progress=False, log=lambda *a: None)
    assert report["layers"] == [0, 3]
    model = AutoModelForCausalLM.from_pretrained(workspace / f"layers-{method}" / "model")
    assert model.config.adept["expanded_layers"] == [1, 5]  # copies right after layers 0 and 3


@pytest.mark.parametrize("task", ["bbc-topic", "context"])
def test_freeze_deep_with_boundary_from_a_diagnosis(workspace, task):
    report = run(options(workspace, f"auto-{task}", method="freeze_deep", boundary="auto", diagnosis_task=task,
                         diagnosis_queries=3, steps=1), progress=False, log=lambda *a: None)
    out = workspace / f"auto-{task}"
    diagnosis = json.loads((out / "diagnosis.json").read_text())
    js = diagnosis["sensitivity"]["js"]
    boundary = min(diagnosis["lens"]["task_particle"], max(i for i, j in enumerate(js) if j >= 0.25 * max(js)) + 1)
    assert report["layers"] == list(range(min(max(boundary, 1), 3)))
    assert (out / "diagnosis.png").exists()


def test_cli_diagnose_writes_json_and_png(workspace, tmp_path, capsys):
    argv = ["diagnose", "--model", str(workspace / "tiny"), "--general", str(workspace / "general"),
            "--domain", str(workspace / "domain.jsonl"), "--block-len", "32", "--probe-blocks", "4",
            "--diagnosis-queries", "3", "--out", str(tmp_path / "d"), "--no-progress"]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "d" / "diagnosis.json").read_text())
    assert len(saved["lens"]["p_task"]) == len(saved["sensitivity"]["js"]) == len(saved["importance"]["scores"]) == 4
    assert saved["lens"]["answer_accuracy"] is not None and saved["sensitivity"]["positions"] == 3
    assert (tmp_path / "d" / "diagnosis.png").stat().st_size > 10_000
    assert "freeze_deep --boundary auto trains layers [0, " in capsys.readouterr().out


def test_empty_corpus_is_an_error(workspace, tmp_path):
    (tmp_path / "empty.txt").write_text("   ")
    with pytest.raises(RunError, match="holds no text"):
        run(options(workspace, "empty", general=str(tmp_path / "empty.txt")), progress=False)
    assert not (workspace / "empty").exists()  # nothing written


class Opt:
    """How the tests show an option is wired: `good`, a valid value other than the default, reaches
    the runner through the option's flag; `bad`, a value that must be refused with an `error` (a
    part of its message), given the other flags `needs`. `runtime`: refused once the run starts
    (a path that does not exist), so the real runner runs, on the tiny workspace."""

    def __init__(self, good=None, bad=None, error="", needs=(), runtime=False):
        self.good, self.bad, self.error, self.needs, self.runtime = good, bad, error, needs, runtime


TINY = ("--model", "{tiny}", "--general", "{general}", "--domain", "{domain}", "--block-len", "32")
# Every field of RunConfig and ContinualConfig (continual: CONTINUAL_OPTIONS first). A new option
# without an entry fails test_every_option_is_tested; None as `good` or `bad`: that half does not apply.
# A method's option is given with `--method` set to a method that takes it (`owner_flags`).
OPTIONS = {
    "model": Opt("{tiny}", "{missing}", "is neither an embedded model", runtime=True),
    "out": Opt("{tmp}/elsewhere", "{file}", "is a file, not a directory", TINY, runtime=True),
    "method": Opt("full", "no_such_method", "unknown method 'no_such_method'"),
    "k": Opt(2, 0, "k must be >= 1"),
    "max_length": Opt(64, 1, "max_length must be >= 2"),
    "batch_size": Opt(2, 0, "batch_size must be >= 1"),
    "grad_accum": Opt(2, 0, "grad_accum must be >= 1"),
    "steps": Opt(3, 0, "steps must be >= 1"),
    "lr": Opt(0.001, 0.0, "lr must be a finite number > 0"),
    "warmup_steps": Opt(2, -1, "warmup_steps must be >= 0"),
    "weight_decay": Opt(0.1, -1.0, "weight_decay must be >= 0"),
    "optim": Opt("adamw_8bit", "adamw_4bit", "optim must be one of adamw_torch, adamw_8bit"),  # test_optim_8bit.py
    "max_grad_norm": Opt(0.5, -1.0, "max_grad_norm must be >= 0"),
    "logging_steps": Opt(5, 0, "logging_steps must be >= 1"),
    "gradient_checkpointing": Opt(True),
    "attn_implementation": Opt("eager", "flash", "attn_implementation must be one of sdpa, eager"),
    "loss_implementation": Opt("hf", "logits", "loss_implementation must be one of auto, fused, hf"),
    "compile": Opt(True),
    "probe_blocks": Opt(2, 0, "probe_blocks must be >= 1"),
    "drift_tokens": Opt(64, -1, "drift_tokens must be >= 0"),
    "merge_back": Opt("auto", "1.5", "merge_back must be a number in [0, 1] or auto"),
    "merge_back_schedule": Opt(None, "lines", "--merge-back-schedule needs --merge-back"),  # alone it is refused
    "merge_back_min": Opt(None, 0.5, "--merge-back-min needs --merge-back"),
    "max_forgetting": Opt(None, 0.01, "--max-forgetting needs --merge-back"),
    "eval_blocks": Opt(2, 0, "eval_blocks must be >= 1"),
    "save_every": Opt(5, -1, "save_every must be >= 0"),
    "recompute_every": Opt(5, 0, "recompute_every must be >= 1"),
    "normalize": Opt("per_kind", "bogus", "normalize must be one of"),
    "lora_rank": Opt(4, 0, "lora_rank must be >= 1"),
    "seed": Opt(7),  # every int is a seed
    "bf16": Opt("off", "maybe", "bf16 must be auto, on or off"),
    "frozen_dtype": Opt("float32", "float16", "frozen_dtype must be one of auto, bfloat16, float32, nf4"),
    "device": Opt("cpu", "tpu", "device", TINY, runtime=True),
    "parallel": Opt("fsdp2", "bogus", "parallel must be one of"),  # fsdp2: as if under torchrun (2 processes)
    "resume": Opt(None, True, "holds no adept-ext run"),  # a good --resume needs a stopped run: test_resume_*
    "overwrite": Opt(True),
    "data_workers": Opt(2, -1, "data_workers must be >= 0"),
    "dataloader_num_workers": Opt(2, -1, "dataloader_num_workers must be >= 0"),
    "report_to": Opt("tensorboard", "tensorboard,bogus", "report_to must be none or a comma-separated list"),
    "general": Opt("python-docs", "{missing}", "no such file or folder", TINY[:2], runtime=True),
    "domain": Opt("bbc-news", "{missing}", "no such file or folder", TINY[:4], runtime=True),
    "domain_eval": Opt("{domain}", "{missing}", "--domain-eval"),
    "domain_weights": Opt(None, "0.5", "--domain-weights gives 1 weight(s) for 1 --domain source(s)"),
    "layers": Opt("1,2", "x,y", "--layers must be comma-separated layer indices"),
    "placement": Opt("uniform", "bogus", "placement must be one of"),
    "eval_every": Opt(5, -1, "eval_every must be >= 0"),
    "boundary": Opt("auto", "bogus", "boundary must be half, auto or a layer count"),
    "diagnosis_task": Opt("context", "bogus", "diagnosis_task must be one of"),
    "diagnosis_queries": Opt(3, 0, "diagnosis_queries must be >= 1"),
    "streaming": Opt(True),
    "mix_general": Opt(0.25, 1.0, "mix_general must be in [0, 1)"),
    "tasks": Opt("python-docs,bbc-topic", "{missing}", "no such file or folder", TINY[:2], runtime=True),
    "chat_template": Opt("{file}", "{missing}", "--chat-template"),
    "train_on_prompt": Opt(True),
    "packing": Opt(True, True, "--packing reads whole documents", ("--streaming",)),
    "truncation_mode": Opt("keep_start", "left", "truncation_mode must be one of keep_end, keep_start"),
    "replay_fraction": Opt(0.5, 0.0, "replay_fraction must be in (0, 1]"),
    "replay_base": Opt("lora", "bogus", "replay_base must be one of"),
    "replay_ratio": Opt(0.25, 1.0, "replay_ratio must be in [0, 1)"),
    "replay_select": Opt("balanced", "bogus", "replay_select must be one of"),
    "replay_distill": Opt(0.5, -1.0, "replay_distill must be a finite number >= 0"),
    "replay_distill_top_k": Opt(5, 0, "replay_distill_top_k must be >= 1"),
    "replay_source": Opt("none", "bogus", "replay_source must be one of"),
    "answer_loss": Opt("label_space", "bogus", "answer_loss must be one of"),
    "ema_decay": Opt(0.9, 1.0, "ema_decay must be in [0, 1)"),
    "ewc_lambda": Opt(100.0, -1.0, "ewc_lambda must be a finite number >= 0"),
    "ewc_gamma": Opt(0.9, 1.5, "ewc_gamma must be in [0, 1]"),
    "ewc_samples": Opt(8, 0, "ewc_samples must be >= 1"),
    "ewc_base": Opt("full", "adapter", "ewc_base must be one of lora, full"),
    "lwf_alpha": Opt(0.25, 1.0, "lwf_alpha must be in [0, 1)"),
    "lwf_temperature": Opt(1.0, 0.0, "lwf_temperature must be > 0"),
    "agem_batch": Opt(4, 0, "agem_batch must be >= 1"),
    "freeze_bottom": Opt(1, -1, "freeze_bottom must be >= 0"),
    "merge_tasks_combination": Opt("dare_ties", "svd", "merge_tasks_combination must be one of ties, dare_ties"),
    "merge_tasks_density": Opt(0.2, 0.0, "merge_tasks_density must be in (0, 1]"),
    "merge_tasks_weight": Opt(0.5, 0.0, "merge_tasks_weight must be a finite number > 0"),
    "replay_temperature": Opt(0.7, 0.0, "replay_temperature must be > 0"),
    "label_replay": Opt(True),
    "o_lora_lambda": Opt(1.0, -1.0, "o_lora_lambda must be >= 0"),
    "o_lora_penalty": Opt("l1", "l2", "o_lora_penalty must be one of fro2, l1"),
    "osf_effective_rank": Opt(0.25, 1.5, "osf_effective_rank must be a fraction in (0, 1) or a whole number >= 1"),
    "osf_rank_step": Opt(0.1, 2.0, "osf_rank_step must be 0 or, as osf_effective_rank 0.3 is, a fraction in (0, 1)"),
    "deal_rank": Opt(4, 0, "deal_rank must be >= 1"),
    "deal_variant": Opt("public_code", "bogus", "deal_variant must be one of paper, public_code"),
    "deal_filter": Opt("haar", "bogus", "deal_filter must be one of"),
    "deal_filter_on": Opt("a", "c", "deal_filter_on must be one of"),
    "deal_scales": Opt(2, 0, "deal_scales must be >= 1"),
    "deal_lambda1": Opt(0.1, -1.0, "deal_lambda1 must be a finite number >= 0"),
    "deal_a": Opt(12.0, 1.0, "deal_a >= deal_b >= 1 is needed"),
    "deal_lambda2": Opt(0.1, -1.0, "deal_lambda2 must be a finite number >= 0"),
    "deal_b": Opt(3.0, 0.5, "deal_a >= deal_b >= 1 is needed"),
    "deal_new_rank": Opt(4, -1, "deal_new_rank must be >= 0"),
    "eoupct_student": Opt("full", "bogus", "eoupct_student must be one of"),
    "eoupct_rank": Opt(8, 0, "eoupct_rank must be >= 1"),
    "eoupct_lora_alpha": Opt(16.0, -1.0, "eoupct_lora_alpha must be >= 0"),
    "eoupct_target_modules": Opt("all", "gate_proj,", "eoupct_target_modules must be gate, all or"),
    "eoupct_teacher": Opt("task_start", "bogus", "eoupct_teacher must be one of"),
    "eoupct_proxy": Opt("embeds", "bogus", "eoupct_proxy must be one of"),
    "eoupct_proxy_len": Opt(8, 3, "eoupct_proxy_len must be in 4..32"),
    "eoupct_gen_steps": Opt(4, 0, "eoupct_gen_steps must be >= 1"),
    "eoupct_tau": Opt(0.5, 0.0, "eoupct_tau must be > 0"),
    "eoupct_alpha": Opt(0.1, -1.0, "eoupct_alpha must be >= 0"),
    "eoupct_lambda": Opt(0.2, -1.0, "eoupct_lambda must be >= 0"),
    "eoupct_proxy_every": Opt(2, 0, "eoupct_proxy_every must be >= 1"),
    "eoupct_proxy_steps": Opt(2, 0, "eoupct_proxy_steps must be >= 1"),
    "eoupct_proxy_lr": Opt(0.01, 0.0, "eoupct_proxy_lr must be > 0"),
    "eoupct_no_virtual": Opt(True),
    "eoupct_no_conflict": Opt(True),
    "eoupct_where": Opt("grad", "bogus", "eoupct_where must be one of"),
    "eoupct_target": Opt("logits", "bogus", "eoupct_target must be one of"),
    "eoupct_directions": Opt(2, 0, "eoupct_directions must be >= 1"),
    "eoupct_memory": Opt("gpm", "bogus", "eoupct_memory must be one of"),
    # lm-eval (tests/test_harness.py runs it); a known task name: lm-eval's built-in arc_easy (its data is not read)
    "benchmarks": Opt("arc_easy", "no_such_task", "unknown task 'no_such_task'"),
    "include_path": Opt("{tasks}", "{general}", "no YAML task file"),
    "num_fewshot": Opt(2, -2, "num_fewshot must be >= 0"),
    "limit": Opt(5, 0, "limit must be >= 1"),
    "apply_chat_template": Opt(True),
    "fewshot_as_multiturn": Opt(None, True, "needs --apply-chat-template"),  # alone it is refused
    "log_samples": Opt(True),
    "benchmarks_every": Opt(2, -1, "benchmarks_every must be >= 0"),
}
CONTINUAL_OPTIONS = {  # where a task sequence differs: its own methods and defaults
    "method": Opt("seq_full", "full", "does not learn task sequences"),
    "k": Opt(3, 0, "k must be >= 1"),
    "lora_rank": Opt(4, 0, "lora_rank must be >= 1"),
    "merge_back": Opt("0.5", "auto", "give continual a number in [0, 1]"),
    "out": Opt("{tmp}/elsewhere", "{file}", "is a file, not a directory", TINY[:2], runtime=True),
    "device": Opt("cpu", "tpu", "device", TINY[:2], runtime=True),
    "packing": Opt(True),  # continual has no --streaming to refuse it with
}
def option_cases(half: str):
    from dataclasses import fields

    from adept_ext.continual import ContinualConfig
    from adept_ext.train import RunConfig

    for command, cls in (("run", RunConfig), ("continual", ContinualConfig)):
        for f in fields(cls):
            opt = (CONTINUAL_OPTIONS.get(f.name) if command == "continual" else None) or OPTIONS.get(f.name)
            if opt is None or getattr(opt, half) is not None:
                yield pytest.param(command, f, opt, id=f"{command}-{f.name}")


def test_every_option_is_tested():
    missing = sorted({p.id for half in ("good", "bad") for p in option_cases(half) if p.values[2] is None})
    assert not missing, f"options without an entry in OPTIONS (tests/test_train.py): {missing}"
    tested = {p.values[1].name for half in ("good", "bad") for p in option_cases(half)}
    assert set(OPTIONS) | set(CONTINUAL_OPTIONS) == tested  # and no entry for an option that is gone


def _argv(flag, value, paths):
    if value is True:
        return [flag]
    return [flag, str(value).format(**paths)]


def owner_flags(command, field):
    """`--method M` for a method's option that the command's default method does not take (M: the
    first method that takes it), else nothing."""
    from adept_ext.cli import config_class

    spec = field.metadata.get("methods")
    if spec is None or config_class(command)().method in spec.defaults:
        return []
    return ["--method", next(iter(spec.defaults))]


@pytest.fixture
def paths(workspace, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "tasks").mkdir()  # a folder of lm-eval task files (--include-path checks that it holds YAML)
    (tmp_path / "tasks" / "task.yaml").write_text("task: a_task\n")
    return {"tiny": str(workspace / "tiny"), "general": str(workspace / "general"),
            "domain": str(workspace / "domain.jsonl"), "missing": str(tmp_path / "missing"),
            "file": str(tmp_path / "a-file"), "tmp": str(tmp_path), "tasks": str(tmp_path / "tasks")}


@pytest.fixture
def runner(monkeypatch):
    """The runners replaced by one that records the config it is given (and runs nothing)."""
    import adept_ext.cli as cli
    import adept_ext.continual as continual_module
    import adept_ext.train as train_module

    given = []

    def record(cfg, progress=True, log=print):
        given.append(cfg)
        return {}

    for module in (train_module, continual_module, cli):
        if hasattr(module, "run"):
            monkeypatch.setattr(module, "run", record)
    return given


@pytest.mark.parametrize("command,field,opt", list(option_cases("good")))
def test_help_documents_every_option(command, field, opt, paths, runner, monkeypatch, capsys):
    """Every option has a flag in its command's help, with its default; its flag's value reaches the runner;
    a switch's --no- form turns off what a TOML file turned on."""
    from pathlib import Path

    import adept_ext.parallel

    assert opt is not None, f"no entry for option {field.name} in OPTIONS (tests/test_train.py)"
    if field.name == "parallel":
        monkeypatch.setattr(adept_ext.parallel, "launched_world", lambda: 2)  # fsdp2 is refused outside torchrun
    flag = "--" + field.name.replace("_", "-")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert f" {flag} " in text or f" {flag}, --no-{flag[2:]} " in text  # a switch: both ways
    if not isinstance(field.default, bool):  # a bool option is a switch
        assert f"(default: {field.default})" in text.split(f" {flag} ", 1)[1]
    good = opt.good.format(**paths) if isinstance(opt.good, str) else opt.good
    assert good != field.default
    out = paths["tmp"] + "/out"
    argv = [command, "--out", out, "--no-progress", *owner_flags(command, field), *_argv(flag, opt.good, paths)]
    assert main(argv) == 0
    assert len(runner) == 1 and getattr(runner[0], field.name) == good
    if f"--no-{flag[2:]}" in text:  # and off again after a TOML file turned it on
        toml = Path(paths["tmp"]) / "on.toml"
        toml.write_text(f"{field.name} = true\n")
        assert main([*argv, "--config", str(toml), f"--no-{flag[2:]}"]) == 0
        assert getattr(runner[-1], field.name) is False


@pytest.mark.parametrize("command,field,opt", list(option_cases("bad")))
def test_every_option_refuses_a_bad_value(command, field, opt, paths, monkeypatch, capsys):
    """A bad value of every option is one error line that says what is wrong, before anything is written."""
    from pathlib import Path

    import adept_ext.cli as cli
    import adept_ext.continual as continual_module
    import adept_ext.train as train_module

    assert opt is not None, f"no entry for option {field.name} in OPTIONS (tests/test_train.py)"
    if not opt.runtime:  # refused while the options are checked: no runner may start
        def started(cfg, *args, **kwargs):
            raise AssertionError(f"the run started with {field.name} = {getattr(cfg, field.name)!r}")

        for module in (train_module, continual_module, cli):
            if hasattr(module, "run"):
                monkeypatch.setattr(module, "run", started)
    out = paths["tmp"] + "/out"
    needs = [a.format(**paths) for a in opt.needs]
    argv = [command, "--out", out, "--no-progress", *needs, *owner_flags(command, field),
            *_argv("--" + field.name.replace("_", "-"), opt.bad, paths)]
    assert main(argv) == 2  # the last --out is the one that counts
    assert opt.error in capsys.readouterr().err
    assert not Path(out).exists() and Path(paths["file"]).read_text() == "not a directory"


def test_resume_takes_the_runs_own_options_and_refuses_conflicting_ones(workspace, monkeypatch, capsys):
    out = workspace / "resume-cli"
    import adept_ext.training.one_domain as one_domain

    real_evaluate = one_domain.evaluate
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the first mid-run evaluation, after the step-2 checkpoint
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(one_domain, "evaluate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(options(workspace, "resume-cli", method="full", steps=4, gradient_checkpointing=True), progress=False,
            log=lambda *a: None)
    monkeypatch.setattr(one_domain, "evaluate", real_evaluate)
    assert main(["run", "--out", str(out), "--resume", "--method", "lora", "--no-progress"]) == 2
    assert "differs from the run's own method ('full')" in capsys.readouterr().err
    marker = json.loads((out / "run.json").read_text())
    older = {**marker, "config": {k: v for k, v in marker["config"].items() if k != "optim"}}
    (out / "run.json").write_text(json.dumps(older))  # a run started before --optim existed: it ran adamw_torch
    assert main(["run", "--out", str(out), "--resume", "--optim", "adamw_8bit", "--no-progress"]) == 2
    assert "differs from the run's own optim ('adamw_torch')" in capsys.readouterr().err
    (out / "run.json").write_text(json.dumps(marker))
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    assert checkpoint["world_size"] == 1
    torch.save({**checkpoint, "world_size": 2}, out / "checkpoint.pt")  # as if written by 2 torchrun processes
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "checkpointed by 2 process(es) and this is 1" in capsys.readouterr().err
    torch.save(checkpoint, out / "checkpoint.pt")
    assert main(["run", "--out", str(out), "--resume", "--steps", "5", "--no-gradient-checkpointing", "--no-compile",
                 "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "full" and report["config"]["steps"] == 5 and len(report["history"]["train"]) == 5
    assert report["config"]["gradient_checkpointing"] is False and report["config"]["compile"] is False
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "is finished" in capsys.readouterr().err


def test_a_run_stopped_before_its_first_checkpoint_says_what_works(workspace, capsys):
    from adept_ext.training import prepare_out

    cfg = options(workspace, "crashed")
    prepare_out(cfg, "run")  # what a run writes first; then it died
    base = ["run", "--out", cfg.out, "--model", cfg.model, "--no-progress"]
    assert main(base) == 2
    assert "holds an unfinished run" in capsys.readouterr().err
    assert main(base + ["--resume"]) == 2
    assert "stopped before its first checkpoint; start it again with --overwrite" in capsys.readouterr().err


def test_overwrite_never_deletes_a_directory_adept_ext_did_not_write(workspace, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("my notes")
    argv = ["run", "--out", str(tmp_path), "--overwrite", "--model", str(workspace / "tiny"), "--no-progress"]
    assert main(argv) == 2
    assert "did not write" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "my notes"


def test_each_command_has_its_own_options_default_output_and_description(capsys):
    from adept_ext.cli import build_parser, resolve_config

    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    text = capsys.readouterr().out
    assert "layer importance of --model" in text and "--probe-blocks" in text
    for flag in ("--steps", "--lr", "--lora-rank", "--resume", "--method"):
        assert flag not in text
    for command in ("run", "probe", "diagnose", "eval", "expand", "continual"):
        assert resolve_config(build_parser().parse_args([command])).out == f"runs/{command}"


@pytest.mark.parametrize("line,message", [
    ('lr = "1e-4"', "lr must be of type float, got '1e-4' (str)"),
    ("steps = 2.5", "steps must be of type int, got 2.5 (float)"),
    ("overwrite = 1", "overwrite must be of type bool, got 1 (int)"),
    ("k = true", "k must be of type int, got True (bool)"),
])
def test_toml_values_of_the_wrong_type_are_one_error_line(tmp_path, capsys, line, message):
    cfg = tmp_path / "run.toml"
    cfg.write_text(line + "\n")
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_unknown_toml_option_names_the_file_and_a_likely_option(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("learning_rate = 1e-4\n")
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "unknown option 'learning_rate'; did you mean 'lr'?" in err


def test_a_redeclared_option_keeps_what_the_option_is():
    """A runner's options class that declares an inherited option anew (another default or help text)
    keeps its properties (resumable, one-way, affects results, former and other tools' names, commands)."""
    from dataclasses import fields

    from adept_ext.continual import ContinualOptions
    from adept_ext.methods.base import PROPERTIES
    from adept_ext.train import RunOptions

    checked = 0
    for cls in (RunOptions, ContinualOptions):
        for base in cls.__mro__[1:]:
            inherited = {f.name: f for f in fields(base)} if "__dataclass_fields__" in vars(base) else {}
            for f in fields(cls):
                if f.name in inherited and inherited[f.name] is not f:
                    checked += 1
                    assert ({p: f.metadata.get(p) for p in PROPERTIES}
                            == {p: inherited[f.name].metadata.get(p) for p in PROPERTIES}), (cls, f.name)
    assert checked >= 3  # out and eval_blocks (continual), probe_blocks (run)


@pytest.mark.parametrize("argv,message", [
    (["--lr", "-5"], "lr must be a finite number > 0"),
    (["--lr", "nan"], "lr must be a finite number"),
    (["--k", "0"], "k must be >= 1"),
    (["--block-len", "1"], "max_length must be >= 2"), (["--max-length", "1"], "max_length must be >= 2"),
    (["--weight-decay", "-1"], "weight_decay must be >= 0"),
    (["--probe-blocks", "0"], "probe_blocks must be >= 1"),
    (["--lr", "0"], "lr must be a finite number > 0"),
    (["--lr", "inf"], "lr must be a finite number"),
    (["--batch-size", "0"], "batch_size must be >= 1"),
    (["--steps", "-3"], "steps must be >= 1"),
    (["--max-grad-norm", "nan"], "max_grad_norm must be a finite number"),
])
def test_bad_values_are_refused_before_anything_is_loaded_or_written(tmp_path, capsys, argv, message):
    out = tmp_path / "o"
    assert main(["run", "--out", str(out), "--model", "no-such-model", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err  # not the model error: the values are checked first
    assert not out.exists()


def test_memory_estimate_counts_only_what_trains(workspace):
    from adept_ext.training import check_memory
    from adept_ext.training.device import memory_estimate

    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    cfg = options(workspace, "memory")
    check_memory(cfg, model, trainable=sum(p.numel() for p in model.parameters()))
    with pytest.raises(RunError, match=r"optimizer [0-9.]+, activations .* train fewer parameters"):
        check_memory(cfg, model, trainable=10**12)

    def estimate(part, **kw):
        with pytest.raises(RunError) as e:
            check_memory(**kw)
        return float(re.search(part + r" ([0-9.]+)", str(e.value)).group(1))

    huge = options(workspace, "memory", batch_size=10**6)
    fp32 = estimate("activations", cfg=huge, model=model)
    assert estimate("activations", cfg=huge, model=model, bf16=True) == pytest.approx(fp32 / 2, rel=1e-2)
    assert "lower --batch-size" in str(pytest.raises(RunError, check_memory, huge, model).value)
    fits = check_memory(cfg, model, trainable=1000)
    # 12 bytes a trainable parameter (gradient and two moments), and the step's temporary √v: 4
    assert fits["total"] == fits["weights"] + fits["optimizer"] + fits["activations"] and fits["optimizer"] == 16000
    whole = estimate("optimizer", cfg=cfg, model=model, trainable=10**12)  # 12 bytes per trainable parameter
    assert whole == pytest.approx(10**12 * 12 / 2**30, rel=1e-2)
    assert estimate("optimizer", cfg=cfg, model=model, trainable=10**12, shards=4) == pytest.approx(whole / 4, rel=1e-2)
    accumulating = options(workspace, "memory", grad_accum=2)  # FSDP2 accumulates the gradient unsharded, unsynced
    assert estimate("optimizer", cfg=accumulating, model=model, trainable=10**12, shards=4) == pytest.approx(
        whole * (4 + 8 / 4) / 12, rel=1e-2)
    # the check right after loading (every weight still requires grad, nothing trains yet): no optimizer state,
    # the float32 moments an 8-bit optimizer keeps for trainable embeddings included
    for optim in ("adamw_torch", "adamw_8bit"):
        assert memory_estimate(options(workspace, "memory", optim=optim), model)["optimizer"] == 0, optim
    # a trained LM head: the fused loss holds its float32 gradient [V, H] from the forward to the backward
    model.requires_grad_(False)
    frozen_head = memory_estimate(cfg, model, trainable=1000)["activations"]
    model.lm_head.weight.requires_grad_(True)
    trained_head = memory_estimate(cfg, model, trainable=1000)["activations"]
    assert trained_head == frozen_head + 4 * model.lm_head.weight.numel()


@pytest.mark.parametrize("name", ["domain_aware", "plasticity", "spread"])
def test_run_with_a_placement_records_what_it_measured(workspace, name):
    report = run(options(workspace, f"placement-{name}", placement=name, steps=1), progress=False, log=lambda *a: None)
    saved = json.loads((workspace / f"placement-{name}" / "placement.json").read_text())
    assert saved["placement"] == name and saved["layers"] == report["layers"] and len(report["layers"]) == 2
    if name == "domain_aware":
        assert len(saved["domain"]) == 4
    if name == "plasticity":
        assert len(saved["domain_gradient_energy"]) == 4 and min(saved["domain_gradient_energy"]) > 0


def test_a_config_json_that_is_not_json_is_one_error_line(tmp_path, capsys):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert main(["run", "--model", str(tmp_path / "broken"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adept-ext: error: ") and "cannot be read as a Hugging Face config" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_no_progress_holds_for_one_command_only(tmp_path):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    assert main(["run", "--model", "no-such-model", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert hf_logging.is_progress_bar_enabled()


def test_only_the_librarys_own_input_errors_become_one_line(workspace, monkeypatch, capsys):
    """A ValueError from a bug (here planted in the corpus loading) keeps its traceback; the
    library's input errors (InputError, a ValueError too) are one line."""
    from adept_ext import data
    from adept_ext.errors import InputError

    argv = ["run", "--out", str(workspace / "bug"), "--model", str(workspace / "tiny"), "--general",
            str(workspace / "general"), "--domain", str(workspace / "domain.jsonl"), "--no-progress"]

    def buggy(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(data, "Corpora", buggy)
    with pytest.raises(ValueError, match="an internal bug"):
        main(argv)

    def refusing(*args, **kwargs):
        raise InputError("corpus 'x' holds no text")

    monkeypatch.setattr(data, "Corpora", refusing)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("corpus 'x' holds no text")
    assert issubclass(InputError, ValueError)


def test_cli_probe_reads_a_corpus_folder_through_datasets_with_the_in_memory_blocks(workspace):
    """`adept-ext probe` on a folder corpus scores the probe blocks the in-memory path would cut."""
    from adept_ext import data
    from adept_ext.models import load_model
    from adept_ext.adept.probe import layer_importance

    out = workspace / "probe-cli"
    argv = ["probe", "--model", str(workspace / "tiny"), "--general", str(workspace / "general"), "--out", str(out),
            "--k", "2", "--block-len", "32", "--batch-size", "2", "--probe-blocks", "3", "--no-progress"]
    assert main(argv) == 0
    saved = json.loads((out / "layer_importance.json").read_text())
    model, tokenizer = load_model(str(workspace / "tiny"))
    train, _ = data.split_blocks(data.token_blocks(data.load_texts(str(workspace / "general")), tokenizer, 32), 0.1, 0)
    expected = layer_importance(model, data.batches(data.first_blocks(train, 3), 2), progress=False)
    assert saved["scores"] == pytest.approx(expected.scores, rel=1e-6, abs=1e-9)


def test_a_model_folder_without_a_usable_tokenizer_is_one_error_line(workspace, tmp_path, capsys):
    """A config and weights but no tokenizer: transformers' ValueError becomes one line, before
    anything is written."""
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    model.save_pretrained(tmp_path / "no-tokenizer")
    out = tmp_path / "o"
    assert main(["run", "--model", str(tmp_path / "no-tokenizer"), "--out", str(out), "--no-progress"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert last.startswith("adept-ext: error:") and "cannot be loaded as a Hugging Face causal LM" in last
    assert "tokenizer" in last and not out.exists()


@pytest.mark.parametrize("method", ["adept", "lora", "full", "llama_pro"])
def test_gradient_checkpointing_gives_the_same_losses(workspace, monkeypatch, method):
    """--gradient-checkpointing recomputes each decoder layer in backward (copies, LoRA layers and
    frozen layers alike): the same training and held-out losses; checkpointing really ran (every
    layer, every micro-batch), and only in the run that asked for it."""
    import transformers.modeling_utils

    calls = []
    real = transformers.modeling_utils.checkpoint

    def counting(function, *args, **kwargs):
        calls.append(1)
        return real(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting)
    runs = []
    for on in (False, True):
        calls.clear()
        cfg = options(workspace, f"ckpt-{method}-{on}", method=method, gradient_checkpointing=on)
        runs.append(run(cfg, progress=False, log=lambda *a: None))
        layers = AutoConfig.from_pretrained(workspace / f"ckpt-{method}-{on}" / "model").num_hidden_layers
        assert len(calls) == (cfg.steps * layers if on else 0)  # every layer of every step's forward
    plain, checkpointed = ([h["loss"] for h in r["history"]["train"]] for r in runs)
    assert checkpointed == pytest.approx(plain, rel=1e-6)
    assert runs[1]["final"]["domain_loss"] == pytest.approx(runs[0]["final"]["domain_loss"], rel=1e-6)


@pytest.mark.parametrize("method", ["lora", "adept"])
def test_compile_gives_the_same_losses(workspace, monkeypatch, method):
    """--compile compiles every decoder layer (the copies too) for the training steps and runs
    eager again after them: the same training and held-out losses as without (1e-5), and the
    saved model has the plain state-dict names."""
    compiled = []
    real = torch.nn.Module.compile

    def spy(module, *args, **kwargs):
        compiled.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    runs = [run(options(workspace, f"compile-{method}-{on}", method=method, compile=on, steps=3),
                progress=False, log=lambda *a: None) for on in (False, True)]
    layers = AutoConfig.from_pretrained(workspace / f"compile-{method}-True" / "model").num_hidden_layers
    assert compiled == ["LlamaDecoderLayer"] * layers
    plain, with_compile = ([h["loss"] for h in r["history"]["train"]] for r in runs)
    assert with_compile == pytest.approx(plain, rel=1e-5)
    assert runs[1]["final"]["domain_loss"] == pytest.approx(runs[0]["final"]["domain_loss"], rel=1e-5)
    AutoModelForCausalLM.from_pretrained(workspace / f"compile-{method}-True" / "model")
    monkeypatch.setattr("adept_ext.parallel.launched_world", lambda: 2)  # as if under torchrun
    with pytest.raises(RunError, match="--compile with --parallel fsdp2 is not supported"):
        options(workspace, "compile-fsdp2", compile=True, parallel="fsdp2")


def scalars(log_dir):
    """{tag: [(step, value), ...]} of the TensorBoard event files under `log_dir`, read back with
    TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_writes_every_scalar(workspace):
    """--report-to tensorboard: an event file with the training loss, lr, grad norm, tokens/s,
    peak memory and ADEPT's rate statistics of every step, and every held-out evaluation (base,
    periodic, final), equal to report.json."""
    report = run(options(workspace, "tracked", report_to="tensorboard"), progress=False, log=lambda *a: None)
    got = scalars(workspace / "tracked" / "runs")
    train = report["history"]["train"]
    assert [s for s, _ in got["train/loss"]] == [h["step"] for h in train] == [1, 2, 3, 4]
    assert [v for _, v in got["train/loss"]] == pytest.approx([h["loss"] for h in train], rel=1e-6)
    assert [v for _, v in got["train/lr"]] == pytest.approx([h["lr"] for h in train], rel=1e-6, abs=1e-12)
    for tag in ("train/grad_norm", "train/tokens_per_second", "train/peak_memory_mb", "adept/mean_lr_multiplier",
                "adept/recomputes"):
        assert len(got[tag]) == 4 and all(v > 0 for _, v in got[tag][1:]), tag
    evals = [(0, report["base"])] + [(e["step"], e) for e in report["history"]["eval"]]
    for name in ("general_loss", "domain_loss", "kl_to_base"):
        assert got[f"eval/{name}"] == [(s, pytest.approx(e[name], rel=1e-6)) for s, e in evals]
    assert got["eval/kl_to_base"][0] == (0, 0.0) and all(v > 0 for _, v in got["eval/kl_to_base"][1:])
    assert report["drift"] == {"tokens": 4 * 31, "kl_to_base": report["final"]["kl_to_base"]}
    assert report["stages"]["train"]["tokens_per_second"] > 0


def test_report_to_refuses_a_backend_that_is_not_installed(workspace, monkeypatch):
    from adept_ext.training import tracking

    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(RunError, match=r"--report-to wandb: the package is not installed \(pip install wandb\)"):
        options(workspace, "untracked", report_to="tensorboard,wandb")
    with pytest.raises(RunError, match="report_to must be none or"):
        options(workspace, "untracked", report_to="none,tensorboard")
    assert not (workspace / "untracked").exists()


def test_report_to_mlflow_logs_to_a_local_file_store(workspace, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    report = run(options(workspace, "mlflow", method="lora", report_to="mlflow"), progress=False, log=lambda *a: None)
    mlflow.set_tracking_uri((workspace / "mlflow" / "mlruns").resolve().as_uri())
    (found,) = mlflow.search_runs(experiment_names=["adept-ext"], output_format="list")
    history = mlflow.MlflowClient().get_metric_history(found.info.run_id, "train/loss")
    assert [m.value for m in history] == pytest.approx([h["loss"] for h in report["history"]["train"]], rel=1e-6)


def test_attention_backends_give_the_same_run(workspace, monkeypatch):
    """--attn-implementation eager and sdpa (the default) train to the same losses; the backend
    reaches the model; flash_attention_2 without flash-attn or a GPU is refused before anything
    is written, naming what is missing."""
    import adept_ext.train as train_module

    runs, real = {}, train_module.load_model
    for backend in ("sdpa", "eager"):
        seen = []

        def spy(*args, **kwargs):
            model, tokenizer = real(*args, **kwargs)
            seen.append(model.config._attn_implementation)
            return model, tokenizer

        monkeypatch.setattr(train_module, "load_model", spy)
        runs[backend] = run(options(workspace, f"attn-{backend}", method="lora", attn_implementation=backend),
                            progress=False, log=lambda *a: None)
        assert seen == [backend]
    losses = {b: [h["loss"] for h in r["history"]["train"]] for b, r in runs.items()}
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-5)
    with pytest.raises(RunError, match="flash_attention_2 needs the flash-attn package|runs on CUDA GPUs only"):
        options(workspace, "attn-flash", attn_implementation="flash_attention_2")
    assert not (workspace / "attn-flash").exists()


def test_fused_and_hf_losses_give_the_same_run(workspace):
    """The default loss (fused linear cross-entropy on the plain head of the tiny Llama) and
    --loss-implementation hf give the same training and evaluation losses (1e-5 relative, fp32);
    report.json says which ran."""
    runs = {impl: run(options(workspace, f"loss-{impl}", method="full", steps=3, loss_implementation=impl),
                      progress=False, log=lambda *a: None) for impl in ("auto", "hf")}
    assert runs["auto"]["loss"].startswith("the fused linear cross-entropy")
    assert runs["hf"]["loss"].startswith("Hugging Face's loss") and "--loss-implementation hf" in runs["hf"]["loss"]
    for key in ("train", "eval"):
        got, want = ([[v for k, v in sorted(h.items()) if k != "lr"] for h in r["history"][key]]
                     for r in (runs["auto"], runs["hf"]))
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert a == pytest.approx(b, rel=1e-5)


def test_mix_general_trains_on_general_blocks_never_held_out_or_probed(workspace):
    """--mix-general 0.25: a quarter of the training blocks are general-corpus blocks, spread over
    the batches, none of them a held-out, probe or diagnosis block; every domain training block
    still comes once; the run trains on that mixture (other losses than without) and --streaming
    is refused."""
    from adept_ext.models import load_model
    from adept_ext.data import Corpora

    cfg = options(workspace, "mixed", mix_general=0.25, probe_blocks=2, diagnosis_queries=3)
    tokenizer = load_model(cfg.model)[1]
    mixed, plain = Corpora(cfg, tokenizer), Corpora(options(workspace, "plain", probe_blocks=2), tokenizer)
    rows = lambda batches: [tuple(r.tolist()) for b in batches for r in b["input_ids"]]  # noqa: E731
    general_held = set(rows(mixed.general_eval)) | set(rows(mixed.general_probe)) | set(rows(mixed.general_context))
    pool = set(rows(mixed.general_mixed.batches(4)))
    trained, domain = rows(mixed.domain_train), rows(plain.domain_train)
    from_general = [r for r in trained if r in pool]
    assert not pool & general_held and not set(trained) & general_held
    assert [r for r in trained if r not in pool] == domain  # every domain block once, in order
    assert len(from_general) == len(trained) - len(domain) and 0.2 <= len(from_general) / len(trained) <= 0.3
    a = run(cfg, progress=False, log=lambda *a: None)
    b = run(options(workspace, "plain", probe_blocks=2), progress=False, log=lambda *a: None)
    assert [h["loss"] for h in a["history"]["train"]] != [h["loss"] for h in b["history"]["train"]]
    with pytest.raises(RunError, match="--mix-general .* --streaming"):
        options(workspace, "mixed-stream", mix_general=0.1, streaming=True)


@pytest.mark.parametrize("method", ["adept", "lora"])
def test_a_conversational_domain_trains_the_same_in_every_format(workspace, tmp_path, method):
    """`--domain` as a JSONL of conversations: messages, alpaca, sharegpt and TRL's conversational
    prompt/completion records of the same conversations give the same run (the blocks are the same:
    one per conversation, labelled on the assistant turn), the held-out domain loss (assistant tokens
    only) falls; `--streaming` refuses them."""
    pairs = [(f"Name a colour, number {i}.", ["red", "green", "blue", "black"][i % 4]) for i in range(40)]
    forms = {"messages": [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                          for q, a in pairs],
             "alpaca": [{"instruction": q, "input": "", "output": a} for q, a in pairs],
             "sharegpt": [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                          for q, a in pairs],
             "prompt_completion": [{"prompt": [{"role": "user", "content": q}],  # TRL's conversational form
                                    "completion": [{"role": "assistant", "content": a}]} for q, a in pairs]}
    reports = {}
    for name, records in forms.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        reports[name] = run(options(workspace, f"chat-{method}-{name}", method=method, max_length=64, eval_every=0,
                                    domain=str(tmp_path / f"{name}.jsonl")), progress=False, log=lambda *a: None)
    for name in ("alpaca", "sharegpt", "prompt_completion"):
        assert reports[name]["history"]["train"] == reports["messages"]["history"]["train"]
        assert reports[name]["final"] == reports["messages"]["final"]
    assert reports["messages"]["final"]["domain_loss"] < reports["messages"]["base"]["domain_loss"]
    with pytest.raises(RunError, match="--streaming reads text corpora"):
        run(options(workspace, f"chat-{method}-stream", method=method, max_length=64, streaming=True,
                    domain=str(tmp_path / "messages.jsonl")), progress=False, log=lambda *a: None)


def test_several_domain_sources_are_interleaved_by_weight(workspace, tmp_path):
    """--domain A,B --domain-weights (LLaMA-Factory's interleave_probs): every training block of each
    source trains, the held-out blocks of both are evaluated, a run finishes; bad weights are refused."""
    from adept_ext.data import split_views
    from adept_ext.data.tasks import corpus_or_examples
    from adept_ext.models import load_model
    from adept_ext.data import Corpora

    chats = [{"prompt": f"Colour number {i}?", "completion": " red"} for i in range(12)]
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    domain = f"{workspace / 'domain.jsonl'},{tmp_path / 'qa.jsonl'}"
    cfg = options(workspace, "two-sources", method="lora", domain=domain, domain_weights="1,3", eval_blocks=40)
    tokenizer = load_model(cfg.model)[1]
    corpora = Corpora(cfg, tokenizer)
    rows = lambda batches: {tuple(r) for b in batches for r in b["input_ids"].tolist()}  # noqa: E731
    for source in (workspace / "domain.jsonl", tmp_path / "qa.jsonl"):  # text and prompt/completion
        train, held = split_views(corpus_or_examples(str(source), tokenizer, 32), 0, "a source")
        assert rows(train.batches(2)) <= rows(corpora.domain_train)
        assert rows(held.batches(2)) <= rows(corpora.domain_eval)
    report = run(cfg, progress=False, log=lambda *a: None)
    assert report["config"]["domain_weights"] == "1,3" and report["final"]["domain_loss"] > 0
    for weights, message in (("1", "gives 1 weight"), ("1,-2", "finite number > 0"), ("a,b", "comma-separated")):
        with pytest.raises(RunError, match=message):
            options(workspace, "bad-weights", domain=domain, domain_weights=weights)
    with pytest.raises(RunError, match="--streaming reads one domain corpus"):
        options(workspace, "two-streams", domain=domain, streaming=True)


def test_a_fixed_domain_eval_set_is_held_out_and_every_domain_block_trains(workspace, tmp_path):
    """--domain-eval FILE (TRL's eval_dataset): the held-out domain blocks are that file's, every block
    of --domain trains (in the seed's order), and the report's domain loss is measured on it."""
    from adept_ext.data import corpus_blocks
    from adept_ext.models import load_model
    from adept_ext.data import Corpora
    from adept_ext.training import evaluate

    (tmp_path / "eval.txt").write_text((workspace / "general" / "0.txt").read_text())
    cfg = options(workspace, "fixed-eval", method="lora", domain_eval=str(tmp_path / "eval.txt"), eval_blocks=2)
    model, tokenizer = load_model(cfg.model)
    corpora = Corpora(cfg, tokenizer)
    domain = corpus_blocks(cfg.domain, tokenizer, cfg.max_length)
    held = corpus_blocks(str(tmp_path / "eval.txt"), tokenizer, cfg.max_length)
    assert sum(len(b["input_ids"]) for b in corpora.domain_train) >= len(domain)  # nothing held out of it
    assert torch.equal(torch.cat([b["input_ids"] for b in corpora.domain_eval]),
                       held.rows(list(range(2)))["input_ids"])
    report = run(cfg, progress=False, log=lambda *a: None)
    assert report["base"]["domain_loss"] == pytest.approx(evaluate(model, corpora.domain_eval, "cpu"), rel=1e-6)
    with pytest.raises(RunError, match="--domain-eval .*: no such file or folder"):
        options(workspace, "fixed-eval-missing", domain_eval=str(tmp_path / "missing.txt"))
