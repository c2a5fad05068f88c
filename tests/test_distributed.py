"""Multi-process behaviour with real torch.distributed (2 gloo processes on CPU)."""
import pytest
import torch
import torch.distributed as dist
import ranks
from tiny_models import padded_batches, save_whole_block_llama, tiny_model, write_run_workspace

from adept_ext.lm_loss import next_token_loss
from adept_ext.adept.probe import layer_importance


def _probe_worker(rank, world, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        scores = layer_importance(tiny_model("qwen3", layers=4), padded_batches(n_batches=3), progress=False)
        torch.save(scores.scores + [scores.base_loss, scores.tokens], f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def _step_loss_worker(rank, world, init_file, result_file):
    from test_lm_loss import accumulated_step, uneven_rows
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("llama")
        rows, _ = uneven_rows(STEP_COUNTS)
        torch.save(accumulated_step(model, rows, 2, "fused", wrapped=DistributedDataParallel(model)),
                   f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


STEP_COUNTS = (7, 1, 0, 3)  # rank 0 takes rows 0 and 2 (7 labelled tokens), rank 1 rows 1 and 3 (4)


def test_a_steps_loss_under_ddp_is_the_mean_over_every_ranks_labelled_tokens(tmp_path):
    """2 ranks × 2 micro-batches with 7, 1, 0 and 3 labelled tokens: each rank's gradients (DDP's
    average) and logged loss equal one process's batch of all four rows (the mean over 11 tokens)."""
    from test_lm_loss import assert_same_grads, grads_of, uneven_rows

    ranks.spawn(_step_loss_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    model = tiny_model("llama")
    want_loss = next_token_loss(model, uneven_rows(STEP_COUNTS)[1], "fused")
    want = grads_of(model, want_loss)
    for rank in range(2):
        loss, grads = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert loss == pytest.approx(float(want_loss.detach()), rel=1e-5)
        assert_same_grads(grads, want, 1e-5)


def test_probe_all_reduces_to_the_single_process_result(tmp_path):
    ranks.spawn(_probe_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0 == r1  # identical on every rank
    single = layer_importance(tiny_model("qwen3", layers=4), padded_batches(n_batches=3), progress=False)
    torch.testing.assert_close(torch.tensor(r0, dtype=torch.float64),
                               torch.tensor(single.scores + [single.base_loss, single.tokens], dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)


def _units_worker(rank, world, init_file, result_file, use_ddp):
    from torch.nn.parallel import DistributedDataParallel

    from adept_ext.adept.expand import expand_layers
    from adept_ext.adept.units import UnitImportance

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("qwen3", layers=4)
        expand_layers(model, [0, 2])
        wrapped = DistributedDataParallel(model) if use_ddp else model
        imp = UnitImportance(wrapped, padded_batches(n_batches=4))
        scores = imp.raw_scores()
        if use_ddp:  # DDP training still works after probing (no leaked reducer state)
            opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
            wrapped(**padded_batches(n_batches=1, seed=rank)[0]).loss.backward()
            opt.step()
            scores.append(float(model.model.layers[1].mlp.down_proj.weight.sum()))
        torch.save(scores, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("use_ddp", [False, True])
def test_unit_importance_all_reduces_to_the_single_process_result(tmp_path, use_ddp):
    from adept_ext.adept.expand import expand_layers
    from adept_ext.adept.units import UnitImportance

    ranks.spawn(_units_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out"), use_ddp), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0 == r1  # identical on every rank (with DDP also the synchronised update)
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    single = UnitImportance(model, padded_batches(n_batches=4)).raw_scores()
    torch.testing.assert_close(torch.tensor(r0[:len(single)]), torch.tensor(single), rtol=1e-5, atol=1e-9)


def _projection_ddp_worker(rank, world, init_file, result_file):
    from torch.nn.parallel import DistributedDataParallel

    from adept_ext.projection import GradientMemory, NullSpaceProjector

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        ddp = DistributedDataParallel(model)
        params = list(model.parameters())
        mem = GradientMemory(params, max_directions=4)
        mem.add([[torch.randn_like(p) for p in params] for _ in range(4)])  # same seed: same memory on every rank
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        NullSpaceProjector(opt, mem, where="update")
        before = [p.detach().clone() for p in params]
        torch.manual_seed(100 + rank)  # different data per rank
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(16, 6)).pow(2).mean().backward()
            opt.step()
        delta = [p.detach() - b for p, b in zip(params, before)]
        torch.save({"params": [p.detach() for p in params], "err": mem.orthogonality_error(delta)},
                   f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_projection_under_ddp_is_identical_on_all_ranks(tmp_path):
    ranks.spawn(_projection_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert r0["err"] <= 1e-5


def _projection_sharded_worker(rank, world, init_file, result_file, hsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from adept_ext.projection import GradientMemory

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # HSDP: replicated along the first dimension (2 ranks), sharded along the second (1 rank);
        # else a 1-D mesh with the second parameter replicated and the others sharded
        mesh = init_device_mesh("cpu", (world, 1) if hsdp else (world,))
        placements = [[Replicate(), Shard(0)]] * 3 if hsdp else [[Shard(0)], [Replicate()], [Shard(0)]]
        full_params, full_dirs, full_grads = _sharding_data()
        shard = lambda ts: [distribute_tensor(t, mesh, pl) for t, pl in zip(ts, placements)]  # noqa: E731
        params = [torch.nn.Parameter(p) for p in shard(full_params)]
        mem = GradientMemory(params, max_directions=3)
        mem.add([shard(d) for d in full_dirs])
        state = mem.state_dict()  # whole directions, gathered from every shard
        reloaded = GradientMemory(params, max_directions=3)
        reloaded.load_state_dict(state)
        grads = shard([g.clone() for g in full_grads])
        again = shard([g.clone() for g in full_grads])
        mem.project_(grads)
        reloaded.project_(again)
        torch.save({"grads": [g.full_tensor() for g in grads], "reloaded": [g.full_tensor() for g in again],
                    "storage": state["storage"]}, f"{result_file}.{rank}")
        dist.barrier()  # neither rank tears its mesh's gloo groups down while the other still uses them
    finally:
        dist.destroy_process_group()


def _sharding_data():
    torch.manual_seed(3)
    shapes = [(8, 5), (6,), (4, 3)]
    return ([torch.randn(s) for s in shapes], [[torch.randn(s) for s in shapes] for _ in range(3)],
            [torch.randn(s) for s in shapes])


@pytest.mark.parametrize("hsdp", [False, True], ids=["mesh-2-shard-and-replicate", "hsdp-mesh-2x1"])
def test_projection_with_sharded_parameters_all_reduces_partial_sums(tmp_path, hsdp):
    """Shard(0) and Replicate parameters on a 2-rank mesh, and the HSDP-shaped 2x1 mesh (Replicate,
    Shard(0)), where what is replicated must not be summed once per rank: both project as one
    process does, and the memory's state dict
    holds the whole directions (a memory loaded from it projects the same)."""
    from adept_ext.projection import GradientMemory

    ranks.spawn(_projection_sharded_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out"), hsdp), nprocs=2,
             join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    params, dirs, grads = _sharding_data()
    single = GradientMemory([torch.nn.Parameter(p) for p in params], max_directions=3)
    single.add(dirs)
    storage = single.state_dict()["storage"]
    single.project_(grads)
    for a, b, again, want in zip(r0["grads"], r1["grads"], r0["reloaded"], grads):
        assert torch.equal(a, b) and torch.equal(a, again)
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    for a, b, want in zip(r0["storage"], r1["storage"], storage):
        assert a.shape == want.shape and torch.equal(a, b)
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(rank, world, port, options, result_file, runner="train"):
    """One torchrun-like process: the environment torchrun sets, then the runner as the CLI calls it."""
    import importlib
    import os

    module = importlib.import_module(f"adept_ext.{runner}")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    report = module.run(module.config_from(options), progress=False, log=lambda *a: None)
    if runner == "continual":
        torch.save({"matrix": report["matrix"], "general": report["general_loss"],
                    "replay": [t.get("replay") for t in report["per_task"]]}, f"{result_file}.{rank}")
    else:
        torch.save({"final": report["final"], "train": [h["loss"] for h in report["history"]["train"]],
                    "layers": report["layers"]}, f"{result_file}.{rank}")


def _run_ranks(options, tmp_path):
    """The results of `adept-ext run` with `options` on 2 gloo ranks."""
    ranks.spawn(_run_worker, args=(2, _free_port(), options, str(tmp_path / "r")), nprocs=2, join=True)
    return [torch.load(tmp_path / f"r.{r}") for r in (0, 1)]


def _assert_like_one_process(ranks, single):
    """Both ranks report the same, and the training and final losses of `single` (one process with
    the same global batch) to 1e-4 relative."""
    r0, r1 = ranks
    assert r0 == r1 and r0["layers"] == single["layers"]
    assert r0["train"] == pytest.approx([h["loss"] for h in single["history"]["train"]], rel=1e-4)
    assert r0["final"]["domain_loss"] == pytest.approx(single["final"]["domain_loss"], rel=1e-4)
    assert r0["final"]["general_loss"] == pytest.approx(single["final"]["general_loss"], rel=1e-4)


@pytest.fixture(scope="module")
def run_workspace(tmp_path_factory):
    """The runner tests' files, and `tiny64/`: the tiny Llama whose every frozen projection is held in
    4 bits (`save_whole_block_llama`)."""
    import shutil

    root = write_run_workspace(tmp_path_factory.mktemp("ddp"))
    shutil.copytree(root / "tiny", root / "tiny64")
    save_whole_block_llama(root / "tiny64")
    return root


SCALE_OPTIONS = {"gradient_checkpointing": True, "mix_general": 0.25}  # issue 26's switches, under the engines
# Frozen weights in bfloat16 under (CPU) bf16 autocast; both sides on HF's loss, so the ops match.
FROZEN_BF16 = {"bf16": "on", "frozen_dtype": "bfloat16", "loss_implementation": "hf"}


@pytest.mark.parametrize("method,extra", [("full", {}), ("adept", {}), ("lora", {}), ("lora", SCALE_OPTIONS),
                                          ("adept", FROZEN_BF16), ("full", {"dataloader_num_workers": 2}),
                                          ("lora", {"frozen_dtype": "nf4"})],
                         ids=["full", "adept", "lora", "lora-checkpointing-mix", "adept-frozen-bf16",
                              "full-loader-workers", "lora-nf4"])
def test_run_under_ddp_equals_one_process_with_the_same_global_batch(run_workspace, tmp_path, method, extra):
    """2 gloo ranks x grad_accum 1 take the micro-batches one process takes with grad_accum 2: the
    losses agree to float rounding, rank 0 alone writes, and the model loads with plain transformers.
    The ranks train on the fused loss, the one process on Hugging Face's (--loss-implementation hf)."""
    from transformers import AutoModelForCausalLM

    from adept_ext.train import config_from, run

    ws = run_workspace
    options = dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                   method=method, k=2, max_length=32, batch_size=2, steps=3, warmup_steps=1, probe_blocks=4,
                   eval_blocks=4, eval_every=0, save_every=0, recompute_every=2, lr=1e-3, lora_rank=2, **extra)
    if extra.get("frozen_dtype") == "nf4":
        options["model"] = str(ws / "tiny64")
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single"),
                              "loss_implementation": "hf"}),
                 progress=False, log=lambda *a: None)
    _assert_like_one_process(_run_ranks({**options, "out": str(tmp_path / "ddp")}, tmp_path), single)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp" / "model")
    assert not any("lora" in n for n, _ in saved.named_parameters())
    assert (sorted(p.name for p in (tmp_path / "ddp").iterdir())
            == sorted(p.name for p in (tmp_path / "single").iterdir()))


@pytest.mark.parametrize("method", [dict(method="seq_lora"),
                                    dict(method="replay", replay_base="lora", replay_ratio=0.5, replay_distill=1.0,
                                         replay_select="balanced", replay_fraction=0.5)], ids=["seq_lora", "replay"])
def test_continual_under_ddp_equals_one_process_with_the_same_global_batch(run_workspace, tmp_path, method):
    """Replay's distillation and buffer count too: the ranks' replayed rows add up to one process's."""
    from adept_ext.continual import config_from, run

    ws = run_workspace
    options = dict(model=str(ws / "tiny"), tasks=f"{ws / 'domain.jsonl'},{ws / 'general'}",
                   general=str(ws / "general"), max_length=32, batch_size=2, steps=2,
                   warmup_steps=1, probe_blocks=2, eval_blocks=3, save_every=0, lr=1e-3, lora_rank=2, **method)
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single")}), progress=False,
                 log=lambda *a: None)
    ranks.spawn(_run_worker, args=(2, _free_port(), {**options, "out": str(tmp_path / "ddp")}, str(tmp_path / "r"),
                                "continual"), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r.{r}") for r in (0, 1))
    assert r0 == r1
    flat = [v for row in single["matrix"] for v in row]
    assert [v for row in r0["matrix"] for v in row] == pytest.approx(flat, rel=1e-4, abs=1e-6)
    assert r0["general"] == pytest.approx(single["general_loss"], rel=1e-4)
    assert r0["replay"] == [t.get("replay") for t in single["per_task"]]
    assert (tmp_path / "ddp" / "report.json").exists() and (tmp_path / "ddp" / "model").is_dir()


@pytest.mark.parametrize("method,tied,extra,arch", [
    ("full", True, {}, "llama"), ("adept", False, {}, "llama"), ("llama_pro", False, {}, "llama"),
    ("lora", False, {}, "llama"), ("full", True, SCALE_OPTIONS, "llama"), ("adept", False, {}, "gemma3_text"),
    ("adept", False, {}, "qwen3_moe")],
    ids=["full-tied", "adept", "llama_pro", "lora", "full-tied-checkpointing-mix", "adept-gemma3", "adept-qwen3-moe"])
def test_run_under_fsdp2_equals_one_process_with_the_same_global_batch(run_workspace, tmp_path, method, tied, extra,
                                                                       arch):
    """FSDP2 (fully_shard per decoder layer, 2 gloo ranks) trains what one process trains with the
    same global batch: the losses agree to 1e-4 relative (float rounding of sharded reductions),
    and the saved model is one plain Hugging Face checkpoint with the trained weights (also with
    tied embeddings, as SmolLM2 has; and for a dense and a mixture-of-experts family besides
    Llama). The ranks train on the fused loss (the root gathers the head), the one process on
    Hugging Face's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adept_ext.train import config_from, run

    ws = run_workspace
    model_dir = ws / "tiny"
    if tied or arch != "llama":
        model_dir = tmp_path / f"{arch}-tied" if tied else tmp_path / arch
        tokenizer = AutoTokenizer.from_pretrained(ws / "tiny")
        tiny_model(arch, layers=4, vocab=len(tokenizer), tie=tied).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    options = dict(model=str(model_dir), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                   method=method, k=2, max_length=32, batch_size=2, steps=3, warmup_steps=1, probe_blocks=3,
                   eval_blocks=4, eval_every=2, save_every=0, recompute_every=2, lr=1e-3, **extra)
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single"),
                              "loss_implementation": "hf"}),
                 progress=False, log=lambda *a: None)
    _assert_like_one_process(_run_ranks({**options, "parallel": "fsdp2", "out": str(tmp_path / "fsdp")}, tmp_path),
                             single)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "model")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "model").state_dict()
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-5)
    assert (saved.lm_head.weight is saved.model.embed_tokens.weight) == tied
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == sorted(
        p.name for p in (tmp_path / "single").iterdir())


def _killed_run_worker(rank, world, port, options, result_file):
    """`_run_worker` killed by a KeyboardInterrupt on every rank at the first mid-run evaluation."""
    import adept_ext.training.one_domain as one_domain

    real_evaluate, calls = one_domain.evaluate, []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # base general, base domain, then the first mid-run evaluation
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    one_domain.evaluate = interrupting
    with pytest.raises(KeyboardInterrupt):
        _run_worker(rank, world, port, options, result_file)


def test_sharded_resume_equals_the_uninterrupted_run(run_workspace, tmp_path):
    """An FSDP2 run killed at step 3 resumes from its DCP checkpoint of step 2 (weights and AdamW
    state in per-rank shards, the rest in checkpoint.pt) and ends where one uninterrupted process
    ends; the finished run keeps no shards."""
    from adept_ext.train import config_from, run

    ws = run_workspace
    options = dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                   method="adept", k=2, max_length=32, batch_size=2, steps=4, warmup_steps=1, probe_blocks=2,
                   eval_blocks=3, eval_every=3, save_every=2, recompute_every=2, lr=1e-3)
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single")}), progress=False,
                 log=lambda *a: None)
    sharded = {**options, "parallel": "fsdp2", "out": str(tmp_path / "fsdp")}
    ranks.spawn(_killed_run_worker, args=(2, _free_port(), sharded, str(tmp_path / "r")), nprocs=2, join=True)
    checkpoint = torch.load(tmp_path / "fsdp" / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == 2 and "optimizer" not in checkpoint and "trainable" not in checkpoint
    assert sorted(p.name for p in (tmp_path / "fsdp" / checkpoint["shards"]).iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    _assert_like_one_process(_run_ranks({**sharded, "resume": True}, tmp_path), single)
    assert not list((tmp_path / "fsdp").glob("checkpoint*"))


def _spawn_with_timeout(fn, args, timeout=240):
    """ranks.spawn of 2 processes that fails (instead of hanging) when they have not finished in `timeout` s."""
    import time

    context = ranks.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # False: a process still runs
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {timeout} s (deadlock?)")


def _sharded_probe_worker(rank, world, init_file, result_file, n_batches):
    from torch.distributed.fsdp import fully_shard

    from adept_ext.adept.expand import expand_layers
    from adept_ext.adept.units import UnitImportance

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("qwen3", layers=4)
        expand_layers(model, [0, 2])
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        batches = padded_batches(n_batches=n_batches)  # odd: rank 0 takes one batch more than rank 1
        scores = layer_importance(model, batches, progress=False)
        units = UnitImportance(model, batches).raw_scores(use_source=True)
        torch.save({"layers": scores.scores + [scores.base_loss, scores.tokens], "units": units},
                   f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_probe_and_units_on_an_fsdp2_model_with_unequal_batch_counts_finish_and_equal_one_process(tmp_path):
    """3 probe batches on 2 ranks of a fully_shard model: the ranks make the same collective calls
    (the probe pads rank 1 with a zero-weight batch, unit importance runs every batch on every
    rank), so they finish (timeout) with the single-process scores."""
    from adept_ext.adept.expand import expand_layers
    from adept_ext.adept.units import UnitImportance

    _spawn_with_timeout(_sharded_probe_worker, (2, str(tmp_path / "init"), str(tmp_path / "out"), 3))
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0 == r1
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    single = layer_importance(model, padded_batches(n_batches=3), progress=False)
    torch.testing.assert_close(torch.tensor(r0["layers"], dtype=torch.float64),
                               torch.tensor(single.scores + [single.base_loss, single.tokens], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    units = UnitImportance(model, padded_batches(n_batches=3)).raw_scores(use_source=True)
    torch.testing.assert_close(torch.tensor(r0["units"]), torch.tensor(units), rtol=1e-4, atol=1e-9)


def _hook_count(model):
    return sum(len(getattr(m, kind)) for m in model.modules() for kind in (
        "_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks"))


def _unshard_worker(rank, world, init_file, result_file):
    import copy

    from adept_ext import parallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("llama", layers=2, tie=True)
        hooks, classes = _hook_count(model), [type(m) for m in model.modules()]
        batches = padded_batches(n_batches=4)
        for _ in range(2):  # shard, train, unshard; then the same modules once more
            parallel.fully_shard_model(model, model.model.layers, bf16=False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(2):
                optimizer.zero_grad()
                model(**batches[2 * step + rank]).loss.backward()
                optimizer.step()
            parallel.unshard_model(model)
            assert not parallel.is_sharded(model) and [type(m) for m in model.modules()] == classes
            assert _hook_count(model) == hooks and model.lm_head.weight is model.model.embed_tokens.weight
            copy.deepcopy(model)  # FSDP2 modules refuse deepcopy (the expansion uses it)
        torch.save(model.state_dict(), f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_unshard_model_gives_back_the_plain_model_with_the_trained_weights(tmp_path):
    """`parallel.unshard_model` undoes `fully_shard_model` in place: plain classes, no FSDP hooks,
    tied weights still tied, shardable again, and on every rank the weights one process trains
    with the same global batch (it uses FSDP2 internals: this fails first if torch changes them)."""
    _spawn_with_timeout(_unshard_worker, (2, str(tmp_path / "init"), str(tmp_path / "out")))
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    model, batches = tiny_model("llama", layers=2, tie=True), padded_batches(n_batches=4)
    for _ in range(2):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            optimizer.zero_grad()
            for rank in (0, 1):
                (model(**batches[2 * step + rank]).loss / 2).backward()
            optimizer.step()
    for name, value in model.state_dict().items():
        assert torch.equal(r0[name], r1[name])
        torch.testing.assert_close(r0[name], value, rtol=1e-5, atol=1e-6)


def test_fsdp2_refuses_what_it_cannot_shard_before_any_work(monkeypatch):
    """One error line, before anything is loaded: fsdp2 without torchrun's processes, a sequence
    method whose training hooks need whole weights (o_lora, deal) or no data parallelism (eoupct),
    an unknown engine; the other sequence methods pass."""
    from adept_ext import continual, train
    from adept_ext.errors import RunError

    with pytest.raises(RunError, match="torchrun --nproc-per-node"):
        train.config_from({"parallel": "fsdp2"})
    with pytest.raises(RunError, match="torchrun --nproc-per-node"):
        continual.config_from({"parallel": "fsdp2"})
    with pytest.raises(RunError, match="parallel must be one of ddp, fsdp2"):
        train.config_from({"parallel": "zero3"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    for method in ("o_lora", "deal", "eoupct"):
        with pytest.raises(RunError, match=f"method {method} cannot .* FSDP2 .*--parallel ddp"):
            continual.config_from({"parallel": "fsdp2", "method": method})
    for method in ("seq_full", "seq_lora", "adept_seq", "llama_pro_seq", "replay"):
        assert continual.config_from({"parallel": "fsdp2", "method": method}).parallel == "fsdp2"
    assert train.config_from({"parallel": "fsdp2", "method": "adept"}).parallel == "fsdp2"


def _continual_options(ws, **extra):
    return {**dict(model=str(ws / "tiny"), tasks=f"{ws / 'domain.jsonl'},{ws / 'general'}", general=str(ws / "general"),
                   k=1, max_length=32, batch_size=2, steps=2, warmup_steps=1, probe_blocks=2, eval_blocks=3,
                   save_every=0, recompute_every=2, lr=1e-3, lora_rank=2), **extra}


def _assert_continual_like_one_process(tmp_path, out, single):
    """Both ranks report the same scores and general losses as `single` (1e-4 relative), rank 0
    wrote what one process writes, and the model loads with plain transformers with the weights
    one process saved: to 1e-4 (a tenth of one AdamW step at lr 1e-3), except for at most 1 in
    500 elements of a tensor whose gradient is about AdamW's eps (1e-8), where the rounding of
    the sharded reduction changes the step's size or sign — those within the reach of the run's
    AdamW steps (steps x tasks x lr, with slack 2x)."""
    from transformers import AutoModelForCausalLM

    r0, r1 = (torch.load(tmp_path / f"r.{r}") for r in (0, 1))
    assert r0 == r1
    flat = [v for row in single["matrix"] for v in row]
    assert [v for row in r0["matrix"] for v in row] == pytest.approx(flat, rel=1e-4, abs=1e-6)
    assert r0["general"] == pytest.approx(single["general_loss"], rel=1e-4)
    saved = AutoModelForCausalLM.from_pretrained(out / "model")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "model").state_dict()
    assert sorted(saved.state_dict()) == sorted(want)
    cfg = single["config"]
    reach = 2 * cfg["steps"] * len(cfg["tasks"].split(",")) * cfg["lr"]
    for name, value in saved.state_dict().items():
        diff = (value - want[name]).abs()
        off = diff > 1e-4 + 1e-4 * want[name].abs()
        assert off.float().mean() <= 2e-3 and diff.max() <= reach, (name, int(off.sum()), float(diff.max()))
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*"))  # noqa: E731
    assert listing(out) == listing(tmp_path / "single")


@pytest.mark.parametrize("method", ["seq_lora", "adept_seq", "per_task", "seq_full"])
def test_continual_under_fsdp2_equals_one_process_with_the_same_global_batch(run_workspace, tmp_path, method):
    """Each task prepared on the whole model (adapters, expansion), trained sharded by FSDP2 on 2
    gloo ranks, unsharded before merging and scoring: the same scores as one process with the
    same global batch, and one plain Hugging Face checkpoint."""
    from adept_ext.continual import config_from, run

    options = _continual_options(run_workspace, method=method)
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single")}), progress=False,
                 log=lambda *a: None)
    sharded = {**options, "parallel": "fsdp2", "out": str(tmp_path / "fsdp")}
    _spawn_with_timeout(_run_worker, (2, _free_port(), sharded, str(tmp_path / "r"), "continual"))
    _assert_continual_like_one_process(tmp_path, tmp_path / "fsdp", single)


def _killed_continual_worker(rank, world, port, options, result_file):
    """`_run_worker` (continual) killed by a KeyboardInterrupt on every rank after step 3 of task 2."""
    import adept_ext.training.loop as loop_module

    real, calls = loop_module.train_steps, []

    def interrupted(*args, after_step, **kwargs):
        calls.append(1)

        def after(done):
            after_step(done)
            if len(calls) == 2 and done == 3:
                raise KeyboardInterrupt
        return real(*args, after_step=after, **kwargs)

    loop_module.train_steps = interrupted
    with pytest.raises(KeyboardInterrupt):
        _run_worker(rank, world, port, options, result_file, "continual")


def test_sharded_continual_resume_inside_a_task_equals_the_uninterrupted_run(run_workspace, tmp_path):
    """An FSDP2 sequence killed at step 3 of task 2 resumes from its DCP checkpoint of step 2
    (the model after task 1 in .resume-model, the task's shards per rank) and ends where one
    uninterrupted process ends; the finished run keeps no checkpoint, shards or resume model."""
    from adept_ext.continual import RESUME_MODEL, config_from, run

    options = _continual_options(run_workspace, method="adept_seq", steps=4, save_every=2)
    single = run(config_from({**options, "grad_accum": 2, "out": str(tmp_path / "single")}), progress=False,
                 log=lambda *a: None)
    sharded = {**options, "parallel": "fsdp2", "out": str(tmp_path / "fsdp")}
    _spawn_with_timeout(_killed_continual_worker, (2, _free_port(), sharded, str(tmp_path / "r")))
    checkpoint = torch.load(tmp_path / "fsdp" / "checkpoint.pt", weights_only=True)
    assert (checkpoint["completed"], checkpoint["step"]) == (1, 2)
    assert "optimizer" not in checkpoint and "trainable" not in checkpoint
    assert sorted(p.name for p in (tmp_path / "fsdp" / checkpoint["shards"]).iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert (tmp_path / "fsdp" / RESUME_MODEL).is_dir()
    _spawn_with_timeout(_run_worker, (2, _free_port(), {**sharded, "resume": True}, str(tmp_path / "r"), "continual"))
    _assert_continual_like_one_process(tmp_path, tmp_path / "fsdp", single)


def _accumulated_steps(model, engine=None, grad_accum=4, steps=2):
    """`training.train_steps` of full training on `model` (plain, or under `engine` "ddp"/"fsdp2" over the
    process group): `steps` SGD steps of `grad_accum` micro-batches per rank; the trained weights, whole."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    import adept_ext
    from adept_ext.methods import FullConfig
    from adept_ext.training import shard, train_steps

    task = adept_ext.prepare(model, adept_ext.get_method(FullConfig()), lr=0.1, total_steps=steps, progress=False)
    trained = model
    if engine == "ddp":
        trained = DistributedDataParallel(model)
    elif engine == "fsdp2":
        task.setup = shard(model, task.setup, bf16=False)
    optimizer = torch.optim.SGD(task.param_groups)
    cfg = SimpleNamespace(steps=steps, grad_accum=grad_accum, batch_size=3, max_length=12, logging_steps=steps,
                          max_grad_norm=0.0, dataloader_num_workers=0)
    train_steps(trained, task, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                padded_batches(n_batches=8), cfg, "cpu", False, {"train": []}, 0, "steps", False,
                after_step=lambda step: None)
    return {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in model.named_parameters()}


def _gradient_reductions_worker(rank, world, init_file, result_file, engine):
    """2 steps × 4 micro-batches on each of 2 ranks; saves the trained weights and the gradient reductions counted
    (DDP: backward passes whose last bucket was all-reduced, through a comm hook; FSDP2: reduce-scatters, one per
    sharded module and reducing backward pass)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reductions = [0]
        if engine == "ddp":
            def counting_hook(state, bucket):
                reductions[0] += bucket.is_last()
                return allreduce_hook(state, bucket)

            real_init = DistributedDataParallel.__init__

            def init_with_hook(self, *args, **kwargs):
                real_init(self, *args, **kwargs)
                self.register_comm_hook(None, counting_hook)

            DistributedDataParallel.__init__ = init_with_hook
        else:
            real_reduce_scatter = dist.reduce_scatter_single

            def counting_reduce_scatter(*args, **kwargs):
                reductions[0] += 1
                return real_reduce_scatter(*args, **kwargs)

            dist.reduce_scatter_single = counting_reduce_scatter
        model = tiny_model("llama", layers=2)
        weights = _accumulated_steps(model, engine)
        per_pass = 1 if engine == "ddp" else sum(isinstance(m, FSDPModule) for m in model.modules())
        torch.save({"weights": weights, "reducing_passes": reductions[0] / per_pass}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_gradients_are_reduced_once_per_optimizer_step(tmp_path, engine):
    """With 4 micro-batches per step on 2 gloo ranks the ranks' gradients are reduced in one backward pass per
    optimizer step (the last micro-batch's), and the weights equal one process's with 8 micro-batches per step."""
    ranks.spawn(_gradient_reductions_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out"), engine), nprocs=2,
             join=True)
    want = _accumulated_steps(tiny_model("llama", layers=2), grad_accum=8)
    for rank in range(2):
        result = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert result["reducing_passes"] == 2  # steps, not steps × micro-batches
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
