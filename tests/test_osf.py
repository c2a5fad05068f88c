"""OSF (docs/methods.md §6) through PEFT's OSFConfig: what it trains, its per-task rank schedule,
what it keeps (the top singular directions under a projected gradient step), agreement with
PEFT's own OSF applied directly, the merged model as a plain checkpoint, and `adept-ext continual
--method osf`."""
import copy
import json
import re

import pytest
import torch
from peft import OSFConfig, get_peft_model
from test_continual import options
from tiny_models import padded_batches, tiny_model, write_sequence_workspace
from transformers import AutoModelForCausalLM

import adept_ext
from adept_ext.cli import main
from adept_ext.methods import MethodError, OsfMethodConfig
from adept_ext.methods.lora import target_modules

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model):
    return {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in TARGETS}


def prepared(config=None, task_index=0, model=None, **kw):
    model = tiny_model("llama", layers=2) if model is None else model
    method = adept_ext.get_method(config or OsfMethodConfig())
    task = adept_ext.prepare(model, method, lr=1e-3, total_steps=2, task_index=task_index, progress=False, **kw)
    return model, task


def test_prepare_trains_only_the_low_singular_subspace_and_starts_as_the_model():
    base = tiny_model("llama", layers=2)
    batch = padded_batches()[0]
    with torch.no_grad():
        before = base(**batch).logits
    model, task = prepared(model=copy.deepcopy(base))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {f"{name}.osf_svd_params.default.{part}" for name in projections(base) for part in ("U_low", "S_low",
                                                                                               "V_low")}
    assert names == want and len(want) == 2 * 7 * 3
    assert {id(p) for p in task.trainable} == {id(p) for n, p in model.named_parameters() if n in want}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=1e-5)  # W_low − W_low(start) = 0
    k_proj = model.model.layers[0].self_attn.k_proj  # [16, 32]: d = 16, k = ⌊0.3·16⌋ = 4 frozen, 12 trained
    assert k_proj.effective_rank == {"default": 4}
    assert k_proj.osf_svd_params["default"]["U_low"].shape == (16, 12)
    assert k_proj.osf_svd_params["default"]["V_low"].shape == (12, 32)


@pytest.mark.parametrize("config,ranks", [
    (OsfMethodConfig(), {"q_proj": [9, 16, 22, 28], "k_proj": [4, 8, 11, 14], "down_proj": [9, 16, 22, 28]}),
    (OsfMethodConfig(effective_rank=0.25, rank_step=0.25), {"q_proj": [8, 16, 24], "k_proj": [4, 8, 12]}),
    (OsfMethodConfig(effective_rank=4, rank_step=4), {"q_proj": [4, 8, 12], "k_proj": [4, 8, 12]}),
    (OsfMethodConfig(effective_rank=0.5, rank_step=0), {"q_proj": [16, 16, 16], "k_proj": [8, 8, 8]}),
])
def test_the_preserved_rank_grows_per_task_as_scheduled(config, ranks):
    """k_t = ⌊(r_0 + t·Δ)·d⌋ for fractions (PEFT's rule per projection, d its smaller dimension), r_0 + t·Δ for
    counts: PEFT's guide's schedule (its preserved subspace grows with every task)."""
    for t in range(len(next(iter(ranks.values())))):
        model, task = prepared(config, task_index=t)
        got = {n.rsplit(".", 1)[-1]: m.effective_rank["default"] for n, m in projections(model).items()
               if ".layers.1." in n}
        assert {p: got[p] for p in ranks} == {p: r[t] for p, r in ranks.items()}, f"task {t + 1}"
        task.finish()


@pytest.mark.parametrize("config,task_index,message", [
    (OsfMethodConfig(), 4, "task 5 would preserve all 32 singular directions of model.layers.0.self_attn.q_proj "
                           "(osf_effective_rank + 4 x osf_rank_step = 1.1), leaving nothing to train"),
    (OsfMethodConfig(effective_rank=16, rank_step=0), 0, "task 1 would preserve all 16 singular directions of "
                                            "model.layers.0.self_attn.k_proj"),
    (OsfMethodConfig(effective_rank=0.05), 0, "task 1 preserves 0.05 of model.layers.0.self_attn.k_proj's 16 "
                                              "singular directions, which is none"),
])
def test_a_schedule_that_leaves_nothing_to_train_or_to_keep_is_refused_before_the_model_changes(config, task_index,
                                                                                                message):
    model = tiny_model("llama", layers=2)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(MethodError, match=re.escape(message)):
        prepared(config, task_index=task_index, model=model)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # not wrapped
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    adept_ext.prepare(model, adept_ext.get_method(OsfMethodConfig(effective_rank=0.5, rank_step=0)), lr=1e-3,
                      total_steps=1, progress=False)  # and the model can be prepared (not marked as prepared)


@pytest.mark.parametrize("values,message", [
    (dict(effective_rank=0.0), "osf_effective_rank must be a fraction in (0, 1) or a whole number >= 1, got 0.0"),
    (dict(effective_rank=1.5), "osf_effective_rank must be a fraction in (0, 1) or a whole number >= 1, got 1.5"),
    (dict(effective_rank=float("nan")), "osf_effective_rank must be a fraction"),
    (dict(effective_rank=0.3, rank_step=4.0), "osf_rank_step must be 0 or, as osf_effective_rank 0.3 is, a fraction "
                                              "in (0, 1), got 4.0"),
    (dict(effective_rank=8, rank_step=0.1), "osf_rank_step must be 0 or, as osf_effective_rank 8 is, a whole number "
                                            ">= 1, got 0.1"),
    (dict(rank_step=-0.1), "osf_rank_step must be 0 or"),
])
def test_bad_values_are_refused_by_the_config(values, message):
    with pytest.raises(MethodError, match=re.escape(message)):
        OsfMethodConfig(**values)


def test_a_layer_peft_osf_cannot_wrap_is_refused():
    model = tiny_model("llama", layers=2)
    model.model.layers[1].mlp.up_proj = torch.nn.Identity()
    with pytest.raises(MethodError, match=re.escape("osf: model.layers.1.mlp.up_proj (Identity, no weight): PEFT's "
                                                    "OSF adapts torch.nn.Linear layers")):
        prepared(model=model)


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma2", "mixtral"])
def test_other_families_train_and_merge(arch):
    """Biases (Qwen2), fused projections (Phi-3), Gemma 2, and a mixture of experts (attention only: the
    family's LoRA targets) train one step and merge into a plain model of their class."""
    model = tiny_model(arch, layers=2)
    cls = type(model)
    _, task = prepared(model=model)
    task.loss(padded_batches()[0]).backward()
    assert all(p.grad is not None for p in task.trainable)
    finished = task.finish()
    assert type(finished) is cls and not any("osf" in n for n in finished.state_dict())


def top_directions(weight, k):
    u, _, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return u[:, :k], vh[:k]


@pytest.mark.parametrize("optimizer,kept", [("sgd", True), ("adamw", False)])
def test_the_top_directions_are_kept_by_a_projected_gradient_step(optimizer, kept):
    """After a step, every projection's change ΔW (merged) has U_highᵀ ΔW = 0 and ΔW V_highᵀ = 0
    (W maps its top-k input directions as before) under SGD; AdamW's per-entry scaling of the
    projected gradient moves them too (PEFT projects the gradient, not the update)."""
    base = tiny_model("llama", layers=2)
    model, task = prepared(model=copy.deepcopy(base))
    ks = {n: m.effective_rank["default"] for n, m in projections(model).items()}
    opt = (torch.optim.SGD(task.trainable, lr=0.1) if optimizer == "sgd" else
           torch.optim.AdamW(task.trainable, lr=1e-3, weight_decay=0.0))
    task.loss(padded_batches()[0]).backward()
    opt.step()
    merged = projections(task.finish())
    leaks = []
    for name, m in projections(base).items():
        w = m.weight.detach().double()
        delta = merged[name].weight.detach().double() - w
        u, vh = top_directions(w, ks[name])
        leaks.append(float(((u.T @ delta).norm() + (delta @ vh.T).norm()) / delta.norm()))
    assert (max(leaks) < 1e-3) == kept, leaks  # SGD: float32 rounding of the merge only


def test_the_method_equals_pefts_own_osf_over_two_tasks(tmp_path):
    """Trainable parameters, one AdamW step and the merged weights of each task equal those of
    get_peft_model(model, OSFConfig(target_modules=..., effective_rank=k_t)) applied directly, with
    PEFT's merge_and_unload between the tasks; the merged model reloads with plain transformers."""
    ours = tiny_model("llama", layers=2)
    theirs = copy.deepcopy(ours)
    method = adept_ext.get_method(OsfMethodConfig())
    for t, (effective_rank, batch) in enumerate(zip((0.3, 0.5), padded_batches())):
        task = adept_ext.prepare(ours, method, lr=1e-3, total_steps=1, task_index=t, loss_implementation="hf",
                                 progress=False)
        peer = get_peft_model(theirs, OSFConfig(target_modules=target_modules(theirs), effective_rank=effective_rank))
        mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
        other = {n: p for n, p in theirs.named_parameters() if p.requires_grad}
        assert mine.keys() == other.keys() and all(torch.equal(mine[n], other[n]) for n in mine)
        for params, loss in ((task.param_groups, lambda: task.loss(batch)),
                             ([{"params": list(other.values()), "lr": 1e-3, "weight_decay": 0.01}],
                              lambda: peer(**batch).loss)):
            opt = torch.optim.AdamW(params)
            loss().backward()
            opt.step()
        for n in mine:
            torch.testing.assert_close(mine[n], other[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"task {t + 1} {n}: {m}")
        report = {}
        ours = task.finish(report=report)
        theirs = peer.merge_and_unload()
        assert report == {"osf_effective_rank": effective_rank}
        for (n, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"task {t + 1} {n}: {m}")
        for p in ours.parameters():
            p.requires_grad_(False)
    assert type(ours).__name__ == "LlamaForCausalLM" and not any("osf" in n for n in ours.state_dict())
    ours.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    batch = padded_batches(seed=4)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, ours(**batch).logits, rtol=0, atol=0)


def test_continual_runs_osf_on_two_tasks(tmp_path):
    """`adept-ext continual --method osf` with its two options: the per-task ranks in report.json,
    a plain Hugging Face model saved, the tasks' projections changed."""
    ws = write_sequence_workspace(tmp_path)
    cfg = options(ws, "osf-run")
    out = tmp_path / "osf-run"
    argv = ["continual", "--method", "osf", "--model", cfg.model, "--tasks", cfg.tasks, "--general", cfg.general,
            "--out", str(out), "--max-length", "32", "--batch-size", "2", "--steps", "3", "--warmup-steps", "1",
            "--probe-blocks", "2", "--eval-blocks", "3", "--save-every", "0", "--lr", "1e-3",
            "--osf-effective-rank", "0.25", "--osf-rank-step", "0.25", "--no-progress"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [p["osf_effective_rank"] for p in report["per_task"]] == [0.25, 0.5]
    assert len(report["matrix"]) == 3 and report["metrics"]["BWT"] is not None
    assert json.loads((out / "run.json").read_text())["config"]["osf_rank_step"] == 0.25
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(ws / "tiny")
    changed = [n for (n, a), b in zip(model.state_dict().items(), base.state_dict().values()) if not torch.equal(a, b)]
    assert changed and all(n.rsplit(".", 2)[-2] in TARGETS for n in changed), changed


def test_fsdp2_is_refused_before_anything_is_written(monkeypatch, tmp_path, capsys):
    import adept_ext.parallel

    monkeypatch.setattr(adept_ext.parallel, "launched_world", lambda: 2)  # as if under torchrun
    assert main(["continual", "--method", "osf", "--parallel", "fsdp2", "--out", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    assert "method osf cannot train a model sharded by FSDP2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
