"""--frozen-dtype: the weights that do not train held in bfloat16 during a task (trainable ones,
their gradients and AdamW's moments in float32), exact float32 again for evaluation, merging and
saving (kept on the host where the cast rounds); the memory estimate counts what is held; refused
where it cannot run."""
import json
import re

import pytest
import torch
from test_continual import options as continual_options
from test_continual import quiet
from test_continual import workspace as continual_workspace  # noqa: F401 (module-scoped fixture)
from test_train import options, workspace  # noqa: F401 (module-scoped fixture)
from tiny_models import assert_merged_into_exact
from transformers import AutoModelForCausalLM

import adept_ext.training.loop as loop
from adept_ext.cli import main
from adept_ext.continual import run as run_continual
from adept_ext.errors import RunError
from adept_ext.models.held import release as release_frozen
from adept_ext.train import run
from adept_ext.training.device import exact_host_bytes, hold_frozen, memory_estimate


@pytest.fixture
def held_dtypes(monkeypatch):
    """The dtypes of the trainable and the frozen parameters while the steps of each task run."""
    seen = []
    original = loop.train_steps

    def record(model, task, *args, **kwargs):
        params = list(getattr(model, "module", model).parameters())
        seen.append({"trainable": {p.dtype for p in params if p.requires_grad},
                     "frozen": {p.dtype for p in params if not p.requires_grad}})
        return original(model, task, *args, **kwargs)

    monkeypatch.setattr(loop, "train_steps", record)
    return seen


def test_hold_frozen_holds_only_what_does_not_train_and_releases_it_exact(workspace):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1." in name)
    norm = model.model.norm.weight
    norm.data = norm.data.to(torch.bfloat16).float()  # a weight bfloat16 holds exactly: nothing kept for it
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    cfg = options(workspace, "estimate")
    estimate = memory_estimate(cfg, model, device=torch.device("cuda"))["weights"]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert hold_frozen(model, torch.bfloat16) == len(frozen)
    assert all(p.dtype == (torch.float32 if n in trainable else torch.bfloat16) for n, p in model.named_parameters())
    frozen_numel = sum(p.numel() for p in frozen)
    assert memory_estimate(cfg, model, device=torch.device("cuda"))["weights"] == estimate - 2 * frozen_numel
    assert exact_host_bytes(model) == 4 * (frozen_numel - norm.numel())  # the rounded ones' exact values
    on_cpu = memory_estimate(cfg, model, device=torch.device("cpu"))["weights"]
    assert on_cpu == estimate - 2 * frozen_numel + exact_host_bytes(model)  # there, the same memory
    assert release_frozen(model) == len(frozen) and exact_host_bytes(model) == 0
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_a_tied_embedding_and_head_are_held_once_and_come_back_tied():
    from tiny_models import tiny_model

    model = tiny_model("llama", tie=True)
    model.requires_grad_(False)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed
    before = embed.detach().clone()
    hold_frozen(model, torch.bfloat16)
    assert model.get_output_embeddings().weight is embed and embed.dtype == torch.bfloat16
    assert exact_host_bytes(model) == 4 * sum(p.numel() for p in model.parameters())  # each tensor once
    release_frozen(model)
    assert model.get_output_embeddings().weight is embed and torch.equal(embed, before)


def test_the_estimate_with_checkpointing_keeps_each_layer_s_input_and_one_layer(workspace):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    c = model.config
    plain, checkpointed = (memory_estimate(options(workspace, "e", gradient_checkpointing=g), model)["activations"]
                           for g in (False, True))
    layer = 4 * (16 * c.hidden_size + 4 * c.intermediate_size)
    tokens = 2 * 32  # batch_size x max_length of the workspace's options
    assert plain - checkpointed == tokens * (c.num_hidden_layers * layer - 4 * c.num_hidden_layers * c.hidden_size
                                             - layer)


def test_the_8b_estimate_tool_runs_on_the_meta_device():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "tools/memory_estimate.py", "--max-length", "1024"], capture_output=True,
                         text=True, check=True, cwd=__file__.rsplit("/tests/", 1)[0]).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    adept = {(r["frozen_dtype"], r["gradient_checkpointing"]): r for r in rows if r["method"] == "adept"}
    assert adept["bfloat16", False]["weights"] < adept["float32", False]["weights"] * 0.6
    assert adept["bfloat16", True]["activations"] < adept["bfloat16", False]["activations"]


@pytest.mark.parametrize("method", ["adept", "lora"])
def test_frozen_weights_train_in_bfloat16_and_come_back_in_float32(workspace, method, held_dtypes):  # noqa: F811
    base = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    reports = {}
    for frozen in ("bfloat16", "float32"):
        reports[frozen] = run(options(workspace, f"frozen-{method}-{frozen}", method=method, bf16="on",
                                      frozen_dtype=frozen), progress=False, log=quiet)
    assert held_dtypes[0] == {"trainable": {torch.float32}, "frozen": {torch.bfloat16}}
    assert held_dtypes[1] == {"trainable": {torch.float32}, "frozen": {torch.float32}}
    # The same autocast, so the losses differ only by the frozen weights' rounding (eval_every=2: an
    # evaluation in the middle of the task ran with bfloat16 weights).
    for a, b in zip(reports["bfloat16"]["history"]["train"], reports["float32"]["history"]["train"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
    mid = [e for e in reports["bfloat16"]["history"]["eval"] if 0 < e["step"] < 4]
    assert mid and all(e["general_loss"] == e["general_loss"] for e in mid)  # ran, not NaN
    saved = AutoModelForCausalLM.from_pretrained(workspace / f"frozen-{method}-bfloat16" / "model")
    assert all(p.dtype == torch.float32 for p in saved.parameters())
    embed = base.get_input_embeddings().weight  # frozen in both methods, rounded while held: saved exact
    assert not torch.equal(embed, embed.to(torch.bfloat16).float())
    assert torch.equal(saved.get_input_embeddings().weight, embed)
    assert torch.equal(saved.model.norm.weight, base.model.norm.weight)
    if method == "lora":  # merged into the exact weights: every tensor LoRA does not adapt is the base's, bit for
        kept = {n: p for n, p in saved.named_parameters() if "proj" not in n}  # bit; each it adapts, the base + B·A
        assert all(torch.equal(p, base.get_parameter(n)) for n, p in kept.items()) and len(kept) > 3
        assert_merged_into_exact(saved.state_dict(), base.state_dict(), reports["bfloat16"]["config"]["lora_rank"])
    else:  # ADEPT's originals never train: every one of their tensors is the base's, bit for bit
        copies = saved.config.adept["expanded_layers"]
        originals = [j for j in range(saved.config.num_hidden_layers) if j not in copies]
        for i, j in enumerate(originals):
            for name, p in base.model.layers[i].named_parameters():
                assert torch.equal(saved.model.layers[j].get_parameter(name), p), (j, name)


def test_continual_holds_each_task_s_frozen_weights_in_bfloat16(continual_workspace, monkeypatch,  # noqa: F811
                                                                 held_dtypes):
    """... from the load on: every score row (each task's held-out split, the general text) is of the
    model held as the steps see it, merged on the host and held again; the saved model is exact."""
    import adept_ext.training.sequence as sequence_module

    evaluations, real = [], sequence_module.evaluate
    monkeypatch.setattr(sequence_module, "evaluate", lambda model, *a, **k: evaluations.append(
        {p.dtype for p in model.parameters()}) or real(model, *a, **k))  # between tasks nothing trains
    report = run_continual(continual_options(continual_workspace, "frozen-seq", method="seq_lora", bf16="on",
                                             frozen_dtype="bfloat16"), progress=False, log=quiet)
    assert len(held_dtypes) == len(report["tasks"]) >= 2
    assert all(d == {"trainable": {torch.float32}, "frozen": {torch.bfloat16}} for d in held_dtypes)
    assert all(score == score for row in report["matrix"] for score in row)
    assert len(evaluations) >= len(report["matrix"]) and all(d == {torch.bfloat16} for d in evaluations)
    base = AutoModelForCausalLM.from_pretrained(continual_workspace / "tiny")
    saved = AutoModelForCausalLM.from_pretrained(continual_workspace / "frozen-seq" / "model")
    assert saved.config.dtype == torch.float32 and {p.dtype for p in saved.parameters()} == {torch.float32}
    kept = {n: p for n, p in saved.named_parameters() if "proj" not in n}  # what no task's adapter changes
    assert all(torch.equal(p, base.get_parameter(n)) for n, p in kept.items()) and len(kept) > 3


@pytest.mark.parametrize("argv,message", [
    (["--frozen-dtype", "bfloat16", "--bf16", "off"], "--frozen-dtype bfloat16 needs bf16 autocast"),
    (["--frozen-dtype", "float16"], "frozen_dtype must be one of auto, bfloat16, float32, nf4"),
    (["--frozen-dtype", "bfloat16", "--parallel", "fsdp2"], "--frozen-dtype bfloat16 with --parallel fsdp2"),
    (["--frozen-dtype", "nf4", "--method", "full"], "full trains every one"),
    (["--frozen-dtype", "nf4", "--compile"], "--frozen-dtype nf4 with --compile"),
    (["--frozen-dtype", "nf4", "--parallel", "fsdp2"], "--frozen-dtype nf4 with --parallel fsdp2"),
])
def test_refused_before_anything_is_written(workspace, tmp_path, capsys, argv, message):  # noqa: F811
    out = tmp_path / "o"
    args = ["run", "--out", str(out), "--model", str(workspace / "tiny"), "--general", str(workspace / "general"),
            "--domain", str(workspace / "domain.jsonl"), "--no-progress", *argv]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_auto_is_float32_without_bf16_autocast(workspace, held_dtypes):  # noqa: F811
    report = run(options(workspace, "frozen-auto", method="lora"), progress=False, log=quiet)
    assert held_dtypes[0]["frozen"] == {torch.float32}
    assert json.loads((workspace / "frozen-auto" / "report.json").read_text())["config"]["frozen_dtype"] == "auto"
    assert report["config"]["bf16"] == "auto"
    with pytest.raises(RunError, match="needs bf16 autocast"):
        run(options(workspace, "frozen-off", method="lora", frozen_dtype="bfloat16", bf16="off"), progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (tools/gpu_check.sh runs it)")
def test_auto_holds_frozen_weights_in_bfloat16_on_a_cuda_gpu(workspace, held_dtypes):  # noqa: F811
    report = run(options(workspace, "frozen-cuda", method="adept", device="cuda"), progress=False, log=quiet)
    assert held_dtypes[0] == {"trainable": {torch.float32}, "frozen": {torch.bfloat16}}
    assert all(h["loss"] == h["loss"] for h in report["history"]["train"])
    saved = AutoModelForCausalLM.from_pretrained(workspace / "frozen-cuda" / "model")
    assert all(p.dtype == torch.float32 for p in saved.parameters())


def frozen_dtypes_in_evaluations(monkeypatch) -> list:
    """Per evaluation `run` makes (base, during the task, final): the dtypes of the parameters that
    do not train."""
    import adept_ext.training.one_domain as one_domain

    seen, real = [], one_domain.evaluate

    def record(model, *args, **kwargs):
        seen.append({p.dtype for p in model.parameters() if not p.requires_grad})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(one_domain, "evaluate", record)
    return seen


@pytest.mark.parametrize("method", ["adept", "lora", "freeze_deep"])
def test_run_holds_the_frozen_weights_from_the_load_to_the_export(workspace, monkeypatch, method,  # noqa: F811
                                                                     held_dtypes):
    """Under --frozen-dtype bfloat16 `run` loads the weights held and evaluates the model as the steps
    see it: no frozen weight is float32 in any evaluation (base, during the task, final), and the
    saved model is exact (the test above)."""
    import adept_ext.train as train_module

    evaluations, loaded, real_load = frozen_dtypes_in_evaluations(monkeypatch), [], train_module.load_model
    monkeypatch.setattr(train_module, "load_model", lambda *a, **k: (lambda m: loaded.append(
        {p.dtype for p in m[0].parameters()}) or m)(real_load(*a, **k)))
    report = run(options(workspace, f"held-{method}", method=method, bf16="on", frozen_dtype="bfloat16"),
                 progress=False, log=quiet)
    assert len(evaluations) == 2 * (2 + len([e for e in report["history"]["eval"] if 0 < e["step"] < 4]))
    assert loaded == [{torch.bfloat16}] and all(dtypes == {torch.bfloat16} for dtypes in evaluations)
    assert held_dtypes[0] == {"trainable": {torch.float32}, "frozen": {torch.bfloat16}}
    assert report["evaluated_held"] == "bfloat16"
    assert "held in bfloat16 (--frozen-dtype)" in (workspace / f"held-{method}" / "report.md").read_text()


def test_a_model_loaded_held_is_exact_on_export_and_copies_its_exact_layers(workspace):  # noqa: F811
    from adept_ext.models import held
    from adept_ext.adept.expand import expand_layers
    from adept_ext.models import load_model

    source = AutoModelForCausalLM.from_pretrained(workspace / "tiny").state_dict()  # a float32 checkpoint
    model = load_model(workspace / "tiny", hold=torch.bfloat16)[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rounded = [k for k, v in source.items() if not torch.equal(v, v.to(torch.bfloat16).float())]
    assert rounded and held.held_bytes(model) == 4 * sum(source[k].numel() for k in rounded)
    copies = expand_layers(model, [0])  # a copy of layer 0 after it, from the exact weights
    assert {p.dtype for p in copies} == {torch.float32}
    for name, p in model.model.layers[1].named_parameters():
        if not name.endswith(("o_proj.weight", "down_proj.weight")):  # zeroed: the identity
            assert torch.equal(p, source[f"model.layers.0.{name}"]), name
    held.release(model, trainable_only=True)
    assert held.export_exact(model) > 0 and held.records(model) == []
    exported = model.state_dict()
    for key, value in source.items():  # layer i > 0 is layer i + 1 now
        moved = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + (m[1] != '0')}.", key)
        assert exported[moved].dtype == torch.float32 and torch.equal(exported[moved], value), key



def test_held_assign_keeps_the_exact_value_and_rounds_the_held_copy():
    from tiny_models import tiny_model

    from adept_ext.models import held

    model = tiny_model("llama")
    p = model.model.norm.weight
    held.hold(model, [p], torch.bfloat16)
    value = torch.full_like(p, 1 / 3, dtype=torch.float32)  # bfloat16 rounds it
    held.assign(model, p, value)
    assert p.dtype == torch.bfloat16 and torch.equal(p, value.to(torch.bfloat16))
    assert torch.equal(held.exact_value(model, p), value) and held.export_exact(model) == 1
    assert p.dtype == torch.float32 and torch.equal(p, value)



def test_a_method_that_trains_every_weight_prepares_on_the_exact_weights(continual_workspace,  # noqa: F811
                                                                         monkeypatch):
    """OSF's SVD (and eoupct's full-student teacher) read the weights in `prepare`: the weights the
    load held come back exact first (under bfloat16, PEFT would also recast OSF's factors and drop
    the gradient hooks it set on them)."""
    from adept_ext.methods.osf import Osf

    seen, real = [], Osf.prepare
    monkeypatch.setattr(Osf, "prepare", lambda self, model, *a, **k: seen.append(
        {p.dtype for p in model.parameters()}) or real(self, model, *a, **k))
    run_continual(continual_options(continual_workspace, "osf-held", method="osf", bf16="on",
                                    frozen_dtype="bfloat16"), progress=False, log=quiet)
    assert len(seen) >= 2 and all(dtypes == {torch.float32} for dtypes in seen)
