"""A bfloat16 checkpoint is loaded in bfloat16 where the run holds its frozen weights in bfloat16
(`training.load_dtype`, `models.load_model`'s `held_dtype`): no float32 copy of the model before the
first task, what trains made float32 once the method has chosen it, and the steps the same as from
a float32 checkpoint of the same values."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import adept_ext.train as train
from adept_ext.models import load_model
from adept_ext.train import run
from test_continual import options as continual_options
from test_continual import quiet
from test_continual import workspace as continual_workspace  # noqa: F401 (module-scoped fixture)
from test_train import options, workspace  # noqa: F401 (module-scoped fixture)


@pytest.fixture(scope="module")
def checkpoints(workspace):  # noqa: F811
    """The tiny model stored in bfloat16, and the same values stored in float32."""
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny").to(torch.bfloat16)
    model.save_pretrained(workspace / "tiny-bf16")
    model.float().save_pretrained(workspace / "tiny-bf16-values-in-f32")
    for name in ("tiny-bf16", "tiny-bf16-values-in-f32"):
        for f in (workspace / "tiny").glob("*token*"):
            (workspace / name / f.name).write_bytes(f.read_bytes())
    return workspace / "tiny-bf16", workspace / "tiny-bf16-values-in-f32"


@pytest.fixture
def loaded_dtypes(monkeypatch):
    """The parameter dtypes of every model the run loads, as loaded."""
    seen = []

    def spy(*args, **kwargs):
        model, tokenizer = load_model(*args, **kwargs)
        seen.append({p.dtype for p in model.parameters()})
        return model, tokenizer

    monkeypatch.setattr(train, "load_model", spy)
    return seen


def test_stored_dtype_decides_with_the_held_dtype(checkpoints):
    bf16, f32 = checkpoints
    assert {p.dtype for p in load_model(bf16, held_dtype=torch.bfloat16)[0].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(bf16)[0].parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(bf16, held_dtype=torch.float32)[0].parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(f32, held_dtype=torch.bfloat16)[0].parameters()} == {torch.float32}


@pytest.mark.parametrize("method", ["llama_pro", "adept", "lora"])
def test_loaded_in_bfloat16_trains_as_from_float32(workspace, checkpoints, loaded_dtypes, method):  # noqa: F811
    reports = {}
    for checkpoint in checkpoints:
        reports[checkpoint.name] = run(options(workspace, f"load-{method}-{checkpoint.name}", model=str(checkpoint),
                                               method=method, bf16="on", frozen_dtype="bfloat16", eval_every=0),
                                       progress=False, log=quiet)
    assert loaded_dtypes == [{torch.bfloat16}, {torch.float32}]
    losses = [[h["loss"] for h in r["history"]["train"]] for r in reports.values()]
    saved = [AutoModelForCausalLM.from_pretrained(workspace / f"load-{method}-{c.name}" / "model") for c in checkpoints]
    assert all(p.dtype == torch.float32 for p in saved[0].parameters())
    if method == "lora":  # PEFT initialises A in the base layer's dtype: rounded to bfloat16, then made float32
        assert losses[0][:2] == losses[1][:2] and losses[0] == pytest.approx(losses[1], rel=1e-3)
        return
    assert losses[0] == losses[1]  # the same weights in the same dtypes from step 1 on
    for (name, a), b in zip(saved[0].named_parameters(), saved[1].parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kw", [dict(method="full"), dict(method="lora", frozen_dtype="float32"),
                                dict(method="lora", bf16="off", frozen_dtype="auto")])
def test_float32_where_the_run_holds_nothing_in_bfloat16(workspace, checkpoints, loaded_dtypes, kw):  # noqa: F811
    run(options(workspace, "load-f32", model=str(checkpoints[0]), overwrite=True, eval_every=0, steps=1,
                **{"bf16": "on", **kw}), progress=False, log=quiet)
    assert loaded_dtypes == [{torch.float32}]


def test_nf4_from_a_bfloat16_checkpoint_saves_the_frozen_layers_exactly(workspace, checkpoints, loaded_dtypes):  # noqa: F811
    pytest.importorskip("bitsandbytes")
    run(options(workspace, "load-nf4", model=str(checkpoints[0]), method="llama_pro", bf16="on", frozen_dtype="nf4",
                eval_every=0), progress=False, log=quiet)
    assert loaded_dtypes == [{torch.bfloat16}]
    source = AutoModelForCausalLM.from_pretrained(checkpoints[0]).model.layers
    saved = iter(AutoModelForCausalLM.from_pretrained(workspace / "load-nf4" / "model").model.layers)
    for layer in source:  # each original, in order, among the saved layers (the copies between them)
        assert any(all(torch.equal(a.float(), b) for a, b in zip(layer.parameters(), other.parameters()))
                   for other in saved)


def test_continual_loads_a_bfloat16_checkpoint_in_bfloat16(continual_workspace, monkeypatch):  # noqa: F811
    import adept_ext.continual as continual

    model = AutoModelForCausalLM.from_pretrained(continual_workspace / "tiny").to(torch.bfloat16)
    model.save_pretrained(continual_workspace / "tiny-bf16")
    for f in (continual_workspace / "tiny").glob("*token*"):
        (continual_workspace / "tiny-bf16" / f.name).write_bytes(f.read_bytes())
    seen = []
    monkeypatch.setattr(continual, "load_model",
                        lambda *a, **kw: seen.append(kw["held_dtype"]) or load_model(*a, **kw))
    cfg = continual_options(continual_workspace, "load-seq", model=str(continual_workspace / "tiny-bf16"),
                            method="seq_lora", bf16="on", frozen_dtype="bfloat16")
    report = continual.run(cfg, progress=False, log=quiet)
    assert seen == [torch.bfloat16]
    assert all(score == score for row in report["matrix"] for score in row)
