"""--frozen-dtype nf4: the frozen linear layers of the decoder held in 4 bits (bitsandbytes' NF4,
double quantisation) during a task and `run`'s evaluations, the exact layers back for merging and saving; the
memory estimate counts what is held; refused where it cannot run, before anything is written (the
option combinations: tests/test_frozen_dtype.py)."""
import json

import bitsandbytes as bnb
import pytest
import torch
from test_continual import kill_inside_the_second_task, quiet
from test_continual import options as continual_options
from test_train import killed_and_resumed, options
from tiny_models import LORA_TARGETS, assert_merged_into_exact, save_whole_block_llama, write_sequence_workspace
from transformers import AutoModelForCausalLM

import adept_ext.training.loop as loop
from adept_ext.models import quantize
from adept_ext.cli import main
from adept_ext.continual import run as run_continual
from adept_ext.train import run
from adept_ext.training.device import held_as_frozen, memory_estimate

# Fixed before the runs: a step's loss with 4-bit frozen weights may differ from float32's by this
# much (relative) on the tiny random-weight model at lr 1e-3. Measured since: 0.0008 at the first step
# (lora and adept), then up to 0.0125 as the two runs' weights drift apart (steps 1 to 3).
LOSS_RTOL = 2e-2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The runner tests' files with a tiny Llama whose rows are whole NF4 blocks (`save_whole_block_llama`)."""
    root = write_sequence_workspace(tmp_path_factory.mktemp("nf4"))
    save_whole_block_llama(root / "tiny")
    return root


@pytest.fixture
def held(monkeypatch):
    """Per task, while its steps run: the types of the decoder's linear layers, the dtypes of the
    trainable and the frozen parameters, and each copy layer's state (ADEPT) before step 1."""
    seen = []
    original = loop.train_steps

    def record(model, task, *args, **kwargs):
        inner = getattr(model, "module", model)
        seen.append({"linear_types": {type(m).__name__ for m in inner.modules()
                                      if isinstance(m, torch.nn.Linear) and m is not inner.get_output_embeddings()},
                     "frozen": {p.dtype for p in inner.parameters() if not p.requires_grad},
                     "trainable": {p.dtype for p in inner.parameters() if p.requires_grad},
                     "state": {k: v.detach().clone() for k, v in inner.state_dict().items()
                               if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8}})
        return original(model, task, *args, **kwargs)

    monkeypatch.setattr(loop, "train_steps", record)
    return seen


def test_hold_and_release_are_exact_and_the_estimate_counts_four_bits(workspace):
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1." in name)  # layer 1 trains, the rest is frozen
    source = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = options(workspace, "estimate")
    gpu = torch.device("cuda")  # the estimate for a GPU: the exact layers on the host are not its memory
    before = memory_estimate(cfg, model, device=gpu)["weights"]
    frozen = [name for name, _ in quantize.frozen_linears(model)]
    assert frozen and not any("layers.1." in n for n in frozen)
    ids = torch.randint(0, 200, (2, 12))
    exact = model(ids).logits
    assert quantize.hold_nf4(model, torch.float32) == len(frozen)
    for name in frozen:
        module = model.get_submodule(name)
        assert isinstance(module, bnb.nn.Linear4bit) and module.weight.dtype == torch.uint8
        assert module.weight.numel() * 2 == module.in_features * module.out_features  # two weights a byte
        assert module.weight.quant_state.quant_type == "nf4" and module.weight.quant_state.nested
        original = source[f"{name}.weight"]
        rounded = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        # NF4's widest gap is 0.30 of a block's largest magnitude: half of it, and the scales' own rounding
        assert 0 < (rounded - original).abs().max() <= 0.16 * original.abs().max(), name
    assert type(model.model.layers[1].self_attn.q_proj) is torch.nn.Linear  # trains: untouched
    quantized = model(ids).logits
    assert torch.isfinite(quantized).all() and not torch.equal(quantized, exact)
    linear_numel = sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features for n in frozen)
    held = memory_estimate(cfg, model, device=gpu)["weights"]
    assert held == before - linear_numel * 4 + linear_numel // 2 + quantize.held_bytes(model)
    assert quantize.exact_bytes(model) == linear_numel * 4  # on the CPU, the same memory: counted there
    assert memory_estimate(cfg, model, device=torch.device("cpu"))["weights"] == held + linear_numel * 4
    assert 0 < quantize.held_bytes(model) < linear_numel  # the constants: well under a byte a weight
    assert quantize.release_nf4(model) == len(frozen) and quantize.release_nf4(model) == 0
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in frozen)
    after = model.state_dict()
    assert after.keys() == source.keys() and all(torch.equal(after[k], source[k]) for k in source)  # bit for bit
    assert torch.equal(model(ids).logits, exact)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_base_held_as_a_task_holds_it_then_exact_again(workspace, bf16):
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    model.model.layers[0].mlp.requires_grad_(False)  # whatever trains or not, the base is held whole
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    source = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 200, (2, 12))
    exact = model(ids).logits
    cfg = options(workspace, "held-base", frozen_dtype="nf4", bf16="on" if bf16 else "off")
    with held_as_frozen(model, cfg, bf16) as held:
        linears = [m for layer in held.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
        others = {p.dtype for p in held.parameters() if p.dtype != torch.uint8}
        assert others == {torch.bfloat16 if bf16 else torch.float32}
        assert not any(p.requires_grad for p in held.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            rounded = held(ids).logits
        assert torch.isfinite(rounded).all() and not torch.allclose(rounded.float(), exact)
    after = model.state_dict()
    assert after.keys() == source.keys() and all(torch.equal(after[k], source[k]) for k in source)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == trains
    assert torch.equal(model(ids).logits, exact)


@pytest.mark.parametrize("method", ["lora", "adept"])
def test_a_run_holds_frozen_layers_in_four_bits_and_saves_exact_weights(workspace, method, held):
    source = AutoModelForCausalLM.from_pretrained(workspace / "tiny").state_dict()
    reports = {frozen: run(options(workspace, f"nf4-{method}-{frozen}", method=method, frozen_dtype=frozen),
                           progress=False, log=quiet) for frozen in ("nf4", "float32")}
    during = held[0]
    assert "Linear4bit" in during["linear_types"]
    assert during["trainable"] == {torch.float32} and torch.uint8 in during["frozen"]
    assert held[1]["linear_types"] == {"Linear"}  # the float32 run holds none
    for a, b in zip(reports["nf4"]["history"]["train"], reports["float32"]["history"]["train"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL)
    mid = [e for e in reports["nf4"]["history"]["eval"] if 0 < e["step"] < 4]
    assert mid and all(e["general_loss"] == e["general_loss"] for e in mid)  # evaluated while held: not NaN
    # base and final as the steps saw the model: its frozen layers in 4 bits (the saved model: exact)
    assert reports["nf4"]["evaluated_held"] == "nf4" and reports["float32"]["evaluated_held"] is None
    assert reports["nf4"]["base"].keys() == reports["float32"]["base"].keys()
    assert reports["nf4"]["base"] != reports["float32"]["base"]  # the 4-bit rounding
    assert "held in nf4 (--frozen-dtype)" in (workspace / f"nf4-{method}-nf4" / "report.md").read_text()
    saved = AutoModelForCausalLM.from_pretrained(workspace / f"nf4-{method}-nf4" / "model")  # plain HF reload
    assert not any(type(m).__name__ == "Linear4bit" for m in saved.modules())
    weights = saved.state_dict()
    assert all(w.dtype == torch.float32 for w in weights.values())
    if method == "adept":  # the originals never train: saved bit for bit; each copy began as its source layer
        info = saved.config.adept
        copies = dict(zip(info["expanded_layers"], info["source_layers_before_expansion"]))
        start = held[0]["state"]
        assert copies and all(torch.equal(weights[k], v) for k, v in source.items() if ".layers." not in k)
        for j in range(saved.config.num_hidden_layers):
            i = copies[j] if j in copies else j - sum(c < j for c in copies)
            for key, value in source.items():
                if f".layers.{i}." not in key:
                    continue
                new = key.replace(f".layers.{i}.", f".layers.{j}.")
                if j in copies:  # its output projections zeroed: the identity
                    zeroed = key.endswith(("o_proj.weight", "down_proj.weight"))
                    assert torch.equal(start[new], torch.zeros_like(value) if zeroed else value), new
                else:
                    assert torch.equal(weights[new], value), new
    else:  # LoRA: what no adapter touches is the source's, bit for bit; what it adapts, the source + B·A
        untouched = [k for k in source if not k.endswith(LORA_TARGETS)]
        assert untouched and all(torch.equal(weights[k], source[k]) for k in untouched)
        assert_merged_into_exact(weights, source, reports["nf4"]["config"]["lora_rank"])


@pytest.mark.parametrize("bf16", ["off", "on"])
def test_a_sequence_holds_every_task_s_frozen_layers(workspace, held, monkeypatch, bf16):
    """In 4 bits during each task's steps; between tasks (the score rows) the model merged on the host
    and held as loaded (bfloat16 under bf16 autocast), never a 4-bit layer; saved exact."""
    import adept_ext.training.sequence as sequence_module

    evaluations, real = [], sequence_module.evaluate
    monkeypatch.setattr(sequence_module, "evaluate", lambda model, *a, **k: evaluations.append(
        {p.dtype for p in model.parameters()}) or real(model, *a, **k))
    report = run_continual(continual_options(workspace, f"nf4-seq-{bf16}", method="seq_lora", frozen_dtype="nf4",
                                             bf16=bf16), progress=False, log=quiet)
    assert len(held) == len(report["tasks"]) >= 2
    assert all("Linear4bit" in h["linear_types"] for h in held)
    assert all(score == score for row in report["matrix"] for score in row)
    assert evaluations and all(d == {torch.bfloat16 if bf16 == "on" else torch.float32} for d in evaluations)
    saved = AutoModelForCausalLM.from_pretrained(workspace / f"nf4-seq-{bf16}" / "model")
    assert not any(type(m).__name__ == "Linear4bit" for m in saved.modules())
    source = AutoModelForCausalLM.from_pretrained(workspace / "tiny")
    kept = {n: p for n, p in saved.named_parameters() if "proj" not in n}  # what no task's adapter changes
    assert len(kept) > 3 and all(torch.equal(p, source.get_parameter(n)) for n, p in kept.items())


def test_a_missing_bitsandbytes_and_a_quantized_source_are_refused(workspace, tmp_path, capsys,
                                                                   monkeypatch):
    import shutil
    import sys

    out = tmp_path / "o"
    common = ["run", "--out", str(out), "--general", str(workspace / "general"), "--domain",
              str(workspace / "domain.jsonl"), "--no-progress"]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "bitsandbytes", None)  # import fails
        assert main([*common, "--model", str(workspace / "tiny"), "--frozen-dtype", "nf4"]) == 2
    assert "pip install 'adept-ext[quantization]'" in capsys.readouterr().err
    quantized = tmp_path / "quantized"
    shutil.copytree(workspace / "tiny", quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    assert main([*common, "--model", str(quantized)]) == 2
    assert "is a quantized checkpoint (bitsandbytes" in capsys.readouterr().err
    assert not out.exists()


def test_a_sequence_killed_inside_a_task_resumes_to_the_uninterrupted_result(workspace, monkeypatch):
    """seq_lora with nf4: killed after 3 of the second task's 4 steps (checkpoint at step 2), resumed:
    the layers are held again from the exact weights, so the run continues as if never stopped."""
    whole = run_continual(continual_options(workspace, "nf4-whole", method="seq_lora", frozen_dtype="nf4", steps=4),
                          progress=False, log=quiet)
    kill_inside_the_second_task(monkeypatch, continual_options(workspace, "nf4-killed", method="seq_lora",
                                                               frozen_dtype="nf4", steps=4))
    resumed = run_continual(continual_options(workspace, "nf4-killed", method="seq_lora", frozen_dtype="nf4",
                                              steps=4, resume=True), progress=False, log=quiet)
    assert sum(resumed["matrix"], []) == pytest.approx(sum(whole["matrix"], []), rel=1e-5)
    losses = lambda report: [entry["loss"] for task in report["history"] for entry in task]  # noqa: E731
    assert losses(resumed) == pytest.approx(losses(whole), rel=1e-5)


def test_a_run_killed_inside_the_task_resumes_to_the_uninterrupted_result(workspace, monkeypatch):
    """... and the resumed task checks its memory with the layers held and before the checkpoint's
    optimizer state is allocated (after, it would count that state twice: allocated and needed)."""
    import adept_ext.training.loop as loop

    calls = []
    for name in ("check_memory", "load_training_state"):
        monkeypatch.setattr(loop, name, lambda *a, _real=getattr(loop, name), _name=name, **k:
                            (calls.append(_name), _real(*a, **k))[1])
    full, resumed, checkpoint = killed_and_resumed(workspace, monkeypatch, "nf4-lora", method="lora",
                                                   frozen_dtype="nf4")
    assert calls[-2:] == ["check_memory", "load_training_state"]
    assert checkpoint["base"] == full["base"]  # kept, not evaluated again
    for key in ("base", "final"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5), key
    assert [h["loss"] for h in resumed["history"]["train"]] == pytest.approx(
        [h["loss"] for h in full["history"]["train"]], rel=1e-5)


def test_under_bf16_the_held_layers_come_back_exact(workspace, held):
    """bf16 autocast (the GPU's usual case, --bf16 on here): the frozen weights that are not held in
    4 bits are bfloat16 during the steps, the held layers are quantised from and restored to their
    float32 weights, never rounded to bfloat16 on the way, and the others come back exact too."""
    source = AutoModelForCausalLM.from_pretrained(workspace / "tiny").state_dict()
    run(options(workspace, "nf4-bf16", method="adept", bf16="on", frozen_dtype="nf4"), progress=False, log=quiet)
    assert held[0]["frozen"] == {torch.uint8, torch.bfloat16}  # 4-bit layers; norms, embeddings in bfloat16
    weights = AutoModelForCausalLM.from_pretrained(workspace / "nf4-bf16" / "model").state_dict()
    info = AutoModelForCausalLM.from_pretrained(workspace / "nf4-bf16" / "model").config.adept
    originals = [j for j in range(len(info["expanded_layers"]) + 4) if j not in info["expanded_layers"]]
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    checked = 0
    for i, j in enumerate(originals):
        for key, value in source.items():
            if f".layers.{i}." in key and any(f".{p}." in key for p in projections):
                assert torch.equal(weights[key.replace(f".layers.{i}.", f".layers.{j}.")], value), key
                checked += 1
    assert checked == 4 * len(projections)
    embed = "model.embed_tokens.weight"  # not a linear layer: held as auto holds it, bfloat16, and saved exact
    assert not torch.equal(source[embed], source[embed].to(torch.bfloat16).float())
    assert torch.equal(weights[embed], source[embed])


def test_a_failure_during_the_steps_leaves_no_four_bit_layer(workspace, monkeypatch):
    seen = {}

    def failing(model, task, *args, **kwargs):
        seen["model"] = getattr(model, "module", model)
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in seen["model"].modules())
        raise RuntimeError("out of memory (planted)")

    monkeypatch.setattr(loop, "train_steps", failing)
    with pytest.raises(RuntimeError, match="planted"):
        run(options(workspace, "nf4-failed", method="lora", frozen_dtype="nf4"), progress=False, log=quiet)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in seen["model"].modules())
    assert quantize.release_nf4(seen["model"]) == 0  # nothing left on the host either


def test_a_hold_that_fails_half_way_puts_back_what_it_replaced(workspace, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(workspace / "tiny").requires_grad_(False)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    real, made = bnb.nn.Linear4bit, []

    def third_fails(*args, **kwargs):
        made.append(1)
        if len(made) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bnb.nn, "Linear4bit", third_fails)
    with pytest.raises(KeyboardInterrupt):
        quantize.hold_nf4(model, torch.float32)
    assert len(made) == 3 and not any(isinstance(m, real) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == source.keys() and all(torch.equal(after[k], source[k]) for k in source)
