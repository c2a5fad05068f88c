"""The main job end to end on a tiny real model with the SmolLM2 tokenizer and real text."""
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from adept_ext.cli import main
from adept_ext.train import METHODS, RunError, config_from, run
from tiny_models import write_run_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("run"))


def options(ws, out, **kw):
    base = dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"), out=str(ws / out),
                k=2, block_len=32, batch_size=2, steps=4, warmup_steps=1, probe_blocks=4, eval_blocks=4, eval_every=2,
                save_every=2, recompute_every=2, lr=1e-3)
    base.update(kw)
    return config_from(base)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_and_saves_a_plain_hf_model(workspace, method):
    report = run(options(workspace, f"out-{method}", method=method), progress=False, log=lambda *a: None)
    out = workspace / f"out-{method}"
    assert (out / "report.json").exists() and (out / "report.md").exists() and (out / "loss_curves.png").exists()
    assert not (out / "checkpoint.pt").exists()
    assert (out / "report.json").stat().st_mode & 0o044 and (out / "model").stat().st_mode & 0o055  # umask 022
    saved = json.loads((out / "report.json").read_text())
    assert saved["method"] == method and 0 < saved["trainable_fraction"] <= 1
    assert saved["final"]["domain_loss"] != saved["base"]["domain_loss"]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    expect_layers = 6 if method in ("adept", "llama_pro", "adept_uniform_lr") else 4
    assert model.config.num_hidden_layers == expect_layers
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


@pytest.mark.parametrize("method,streaming", [("adept", False), ("adept_uniform_lr", False), ("full", False),
                                              ("full", True)])
def test_resume_after_interrupt_gives_the_same_result(workspace, monkeypatch, method, streaming):
    """Also with --streaming: the resumed run reads the stream from the start up to its step."""
    run_name = method + ("-streaming" if streaming else "")
    full = run(options(workspace, f"uninterrupted-{run_name}", steps=6, eval_every=3, method=method, streaming=streaming),
               progress=False, log=lambda *a: None)
    import adept_ext.train as train_module

    real_evaluate = train_module.evaluate
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # base general, base domain, then the first mid-run evaluation (step 3)
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(options(workspace, f"killed-{run_name}", steps=6, eval_every=3, method=method, streaming=streaming),
            progress=False, log=lambda *a: None)
    assert (workspace / f"killed-{run_name}" / "checkpoint.pt").exists()
    monkeypatch.setattr(train_module, "evaluate", real_evaluate)
    resumed = run(options(workspace, f"killed-{run_name}", steps=6, eval_every=3, method=method, streaming=streaming,
                          resume=True), progress=False, log=lambda *a: None)
    assert resumed["final"]["domain_loss"] == pytest.approx(full["final"]["domain_loss"], rel=1e-5)
    assert resumed["final"]["general_loss"] == pytest.approx(full["final"]["general_loss"], rel=1e-5)
    assert [h["loss"] for h in resumed["history"]["train"]] == pytest.approx([h["loss"] for h in full["history"]["train"]], rel=1e-5)


def test_cli_run_with_toml_config_and_flag_override(workspace, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    opts = options(workspace, "cli")
    cfg.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in vars(opts).items() if k not in ("resume", "overwrite")))
    assert main(["run", "--config", str(cfg), "--method", "freeze_deep", "--no-progress"]) == 0
    report = json.loads((workspace / "cli" / "report.json").read_text())
    assert report["method"] == "freeze_deep" and report["config"]["block_len"] == 32
    assert main(["run", "--config", str(cfg), "--no-progress"]) == 2
    assert "holds a finished run of `adept-ext run`" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["run", "--model", "no-such-model"], "neither an embedded model"),
    (["run", "--method", "magic"], "unknown method"),
    (["run", "--steps", "0"], "steps must be >= 1"),
    (["run", "--config", "/nonexistent.toml"], "no such file"),
    (["run", "--k", "99"], "not in [1, 4]"),
    (["run", "--batch-size", "100000000"], "lower --batch-size"),
    (["run", "--layers", "1,7"], "--layers [7] out of range"),
    (["run", "--layers", "1;2"], "comma-separated layer indices"),
    (["run", "--method", "full", "--layers", "1"], "--layers applies to"),
    (["run", "--method", "freeze_deep", "--boundary", "4"], "boundary 4 is not in [1, 3]"),
    (["run", "--method", "freeze_deep", "--boundary", "deep"], "boundary must be half, auto"),
    (["diagnose", "--diagnosis-task", "poetry"], "diagnosis_task must be one of"),
    (["run", "--placement", "nearest"], "placement must be one of"),
    (["run", "--method", "llama_pro", "--placement", "spread"], "--placement applies to"),
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


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--method", "--k", "--lr", "--steps", "--resume", "--overwrite", "--config", "--recompute-every"):
        assert flag in text
    assert "(default: adept)" in text and "(default: 0.0003)" in text


def test_resume_takes_the_runs_own_options_and_refuses_conflicting_ones(workspace, monkeypatch, capsys):
    out = workspace / "resume-cli"
    import adept_ext.train as train_module

    real_evaluate = train_module.evaluate
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the first mid-run evaluation, after the step-2 checkpoint
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run(options(workspace, "resume-cli", method="full", steps=4), progress=False, log=lambda *a: None)
    monkeypatch.setattr(train_module, "evaluate", real_evaluate)
    assert main(["run", "--out", str(out), "--resume", "--method", "lora", "--no-progress"]) == 2
    assert "differs from the run's own method ('full')" in capsys.readouterr().err
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    assert checkpoint["world_size"] == 1
    torch.save({**checkpoint, "world_size": 2}, out / "checkpoint.pt")  # as if written by 2 torchrun processes
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "checkpointed by 2 process(es) and this is 1" in capsys.readouterr().err
    torch.save(checkpoint, out / "checkpoint.pt")
    assert main(["run", "--out", str(out), "--resume", "--steps", "5", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "full" and report["config"]["steps"] == 5 and len(report["history"]["train"]) == 5
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "is finished" in capsys.readouterr().err


def test_a_run_stopped_before_its_first_checkpoint_says_what_works(workspace, capsys):
    from adept_ext.rundir import prepare_out

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


@pytest.mark.parametrize("argv,message", [
    (["--lr", "-5"], "lr must be a finite number > 0"),
    (["--lr", "nan"], "lr must be a finite number"),
    (["--k", "0"], "k must be >= 1"),
    (["--block-len", "1"], "block_len must be >= 2"),
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
    from adept_ext.train import _check_memory

    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    cfg = options(workspace, "memory")
    _check_memory(cfg, model, trainable=sum(p.numel() for p in model.parameters()))
    with pytest.raises(RunError, match=r"optimizer [0-9.]+, activations .* train fewer parameters"):
        _check_memory(cfg, model, trainable=10**12)

    def estimate(part, **kw):
        with pytest.raises(RunError) as e:
            _check_memory(**kw)
        return float(re.search(part + r" ([0-9.]+)", str(e.value)).group(1))

    huge = options(workspace, "memory", batch_size=10**6)
    fp32 = estimate("activations", cfg=huge, model=model)
    assert estimate("activations", cfg=huge, model=model, bf16=True) == pytest.approx(fp32 / 2, rel=1e-2)
    assert "lower --batch-size" in str(pytest.raises(RunError, _check_memory, huge, model).value)
    whole = estimate("optimizer", cfg=cfg, model=model, trainable=10**12)  # 12 bytes per trainable parameter
    assert whole == pytest.approx(10**12 * 12 / 2**30, rel=1e-2)
    assert estimate("optimizer", cfg=cfg, model=model, trainable=10**12, shards=4) == pytest.approx(whole / 4, rel=1e-2)


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
    import adept_ext.train as train_module
    from adept_ext.rundir import InputError

    argv = ["run", "--out", str(workspace / "bug"), "--model", str(workspace / "tiny"), "--general",
            str(workspace / "general"), "--domain", str(workspace / "domain.jsonl"), "--no-progress"]

    def buggy(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(train_module, "Corpora", buggy)
    with pytest.raises(ValueError, match="an internal bug"):
        main(argv)

    def refusing(*args, **kwargs):
        raise InputError("corpus 'x' holds no text")

    monkeypatch.setattr(train_module, "Corpora", refusing)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("corpus 'x' holds no text")
    assert issubclass(InputError, ValueError)


def test_cli_probe_reads_a_corpus_folder_through_datasets_with_the_in_memory_blocks(workspace):
    """`adept-ext probe` on a folder corpus scores the probe blocks the in-memory path would cut."""
    from adept_ext import data
    from adept_ext.models import load_model
    from adept_ext.probe import layer_importance

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
