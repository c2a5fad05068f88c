"""A checkpoint stored in bfloat16 is read as stored and made float32 on the device one tensor at a
time (`models.load_model`): the same model, and the same run, as from a float32 checkpoint of the
same values, without a float32 copy of the whole model on the host."""
import pytest
import torch
from test_continual import quiet
from test_train import options, workspace  # noqa: F401 (module-scoped fixture)
from transformers import AutoModelForCausalLM

import adept_ext.models.loading as loading
from adept_ext.models import load_model
from adept_ext.train import run


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


def test_read_as_stored_and_made_float32_tensor_by_tensor(checkpoints, monkeypatch):
    read = []
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: read.append(kw["dtype"]) or original(*a, **kw))
    converted = []
    place_model = loading.place_model
    def recorded(model, *args):
        converted.append({p.dtype for p in model.parameters()})
        return place_model(model, *args)

    monkeypatch.setattr(loading, "place_model", recorded)
    bf16, f32 = (load_model(c)[0] for c in checkpoints)
    assert read == [torch.bfloat16, torch.float32] and converted == [{torch.bfloat16}, {torch.float32}]
    for (name, a), b in zip(bf16.state_dict().items(), f32.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for (name, a), b in zip(bf16.named_buffers(), f32.buffers()):  # non-persistent ones too (rotary inv_freq)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("method,kw", [("adept", {}), ("lora", {}),
                                       ("llama_pro", dict(bf16="on", frozen_dtype="bfloat16"))])
def test_a_run_from_bfloat16_equals_one_from_float32(workspace, checkpoints, method, kw):  # noqa: F811
    reports = [run(options(workspace, f"load-{method}-{c.name}", model=str(c), method=method, **kw), progress=False,
                   log=quiet) for c in checkpoints]
    for key in ("base", "final", "layers", "forgetting_general_delta", "gain_domain_delta"):
        assert reports[0][key] == reports[1][key], key
    assert [h["loss"] for h in reports[0]["history"]["train"]] == [h["loss"] for h in reports[1]["history"]["train"]]
    saved = [AutoModelForCausalLM.from_pretrained(workspace / f"load-{method}-{c.name}" / "model") for c in checkpoints]
    for (name, a), b in zip(saved[0].named_parameters(), saved[1].parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def test_held_from_the_load_a_bfloat16_checkpoint_keeps_no_host_copy(checkpoints):
    """`run`'s load under --frozen-dtype bfloat16 (`load_model(hold=...)`): every weight bfloat16 on
    the device, nothing kept on the host for a checkpoint stored in bfloat16, and float32 again, the
    same values, once exported."""
    from adept_ext.models import held

    model = load_model(checkpoints[0], hold=torch.bfloat16)[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and held.held_bytes(model) == 0
    assert held.export_exact(model) == len(list(model.parameters()))
    exact = load_model(checkpoints[1])[0].state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, exact[k]) for k, v in model.state_dict().items())
