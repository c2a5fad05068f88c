"""Multi-process behaviour with real torch.distributed (2 gloo processes on CPU)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adept_ext.probe import layer_importance
from tiny_models import padded_batches, tiny_model


def _probe_worker(rank, world, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        scores = layer_importance(tiny_model("qwen3", layers=4), padded_batches(n_batches=3), progress=False)
        torch.save(scores.scores + [scores.base_loss, scores.tokens], f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_probe_all_reduces_to_the_single_process_result(tmp_path):
    mp.spawn(_probe_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0 == r1  # identical on every rank
    single = layer_importance(tiny_model("qwen3", layers=4), padded_batches(n_batches=3), progress=False)
    torch.testing.assert_close(torch.tensor(r0, dtype=torch.float64),
                               torch.tensor(single.scores + [single.base_loss, single.tokens], dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)


def _units_worker(rank, world, init_file, result_file, use_ddp):
    from torch.nn.parallel import DistributedDataParallel

    from adept_ext.expand import expand_layers
    from adept_ext.units import UnitImportance

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
    from adept_ext.expand import expand_layers
    from adept_ext.units import UnitImportance

    mp.spawn(_units_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out"), use_ddp), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert r0 == r1  # identical on every rank (with DDP also the synchronised update)
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    single = UnitImportance(model, padded_batches(n_batches=4)).raw_scores()
    torch.testing.assert_close(torch.tensor(r0[:len(single)]), torch.tensor(single), rtol=1e-5, atol=1e-9)
