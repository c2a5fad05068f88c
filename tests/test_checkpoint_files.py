"""Checkpoint files load data, never code: FSDP2 shards as safetensors read with no pickle, and a
checkpoint.pt that names shards outside its run's own `checkpoint-shards-<step>` refused."""
import pickle

import pytest
import torch
import torch.distributed as dist
import ranks
from tiny_models import padded_batches, tiny_model

from adept_ext.errors import InputError
from adept_ext.training.checkpoint import load_training_state, read_checkpoint


def _forbid_unpickling():
    """From here on in this process, any unpickling other than torch's weights-only loader raises."""
    def refused(*args, **kwargs):
        raise AssertionError("unpickled")

    real_load = torch.load

    def weights_only_load(*args, weights_only=None, **kwargs):
        if weights_only is not True:
            raise AssertionError(f"torch.load(weights_only={weights_only})")
        return real_load(*args, weights_only=True, **kwargs)

    pickle.load = pickle.loads = refused
    pickle.Unpickler = refused
    torch.load = weights_only_load


def _steps(model, optimizer, batches):
    for batch in batches:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()


def _sharded(seed):
    """A tiny FSDP2 Llama and its GroupedAdamW over two groups with their own lr and weight decay."""
    from adept_ext import parallel
    from adept_ext.optim import make_optimizer

    model = tiny_model("llama", layers=2, seed=seed)
    parallel.fully_shard_model(model, model.model.layers, bf16=False)
    params = list(model.parameters())
    groups = [{"params": params[:3], "lr": 3e-2, "weight_decay": 0.1}, {"params": params[3:]}]
    return model, make_optimizer("adamw_torch", groups, lr=1e-2, weight_decay=0.0, betas=(0.8, 0.9))


def _round_trip_worker(rank, world, init_file, result_file, shards):
    from pathlib import Path

    from adept_ext import parallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batches = padded_batches(n_batches=6)[rank::2]
        model, optimizer = _sharded(seed=0)
        _steps(model, optimizer, batches[:2])
        values = parallel.save_sharded(Path(shards), model, optimizer)
        _steps(model, optimizer, batches[2:])  # the uninterrupted run
        resumed, resumed_optimizer = _sharded(seed=1)  # other weights, no optimizer state yet
        _forbid_unpickling()
        parallel.load_sharded(Path(shards), resumed, resumed_optimizer, values)
        assert resumed_optimizer.param_groups[0]["lr"] == 3e-2 and resumed_optimizer.param_groups[1]["betas"] == (
            0.8, 0.9)
        _steps(resumed, resumed_optimizer, batches[2:])
        dist.barrier()
        torch.save({"uninterrupted": {n: p.full_tensor() for n, p in model.named_parameters()},
                    "resumed": {n: p.full_tensor() for n, p in resumed.named_parameters()}}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sharded_save_then_load_reads_no_pickle_and_continues_exactly(tmp_path):
    """2 gloo ranks: FSDP2 weights and AdamW state saved after 2 steps, loaded into a fresh model with
    every unpickler but torch's weights-only one refused, then stepped once more: bit-identical to
    the uninterrupted run. The shard directory holds one safetensors file per rank, nothing else."""
    ranks.spawn(_round_trip_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "r"), str(tmp_path / "shards")),
             nprocs=2, join=True)
    assert all(p.suffix == ".safetensors" for p in (tmp_path / "shards").iterdir())
    assert len(list((tmp_path / "shards").iterdir())) == 2
    for rank in (0, 1):
        result = torch.load(tmp_path / f"r.{rank}", weights_only=True)
        torch.testing.assert_close(result["resumed"], result["uninterrupted"], rtol=0, atol=0)


def _write_checkpoint(out, **entries):
    torch.save({"step": 2, "world_size": 1, **entries}, out / "checkpoint.pt")


def test_a_checkpoint_naming_shards_outside_its_run_is_refused(tmp_path):
    """An absolute path, `..` or another step's directory: InputError before anything loads."""
    out = tmp_path / "run"
    (out / "checkpoint-shards-2").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for name in (str(tmp_path / "elsewhere"), "../elsewhere", "checkpoint-shards-2/..", "checkpoint-shards-1"):
        _write_checkpoint(out, shards=name)
        with pytest.raises(InputError, match="names the shard directory"):
            read_checkpoint(out)
    (out / "checkpoint-shards-2").rmdir()
    (out / "checkpoint-shards-2").symlink_to(tmp_path / "elsewhere")
    _write_checkpoint(out, shards="checkpoint-shards-2")
    with pytest.raises(InputError, match="is not a directory of the run"):
        read_checkpoint(out)


class _Payload:
    """Unpickling it runs `open(path, "w")`: the marker shows that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_planted_pickle_in_the_shard_directory_is_never_run(tmp_path):
    """A `.metadata` whose unpickling would create a marker file (what DCP's pickle format reads
    first): resuming refuses the directory, naming the file, and the marker never appears."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    (out / "checkpoint-shards-2").mkdir(parents=True)
    (out / "checkpoint-shards-2" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _write_checkpoint(out, shards="checkpoint-shards-2", shard_values={})
    with pytest.raises(InputError, match=r"holds \.metadata, not safetensors shards only"):
        read_checkpoint(out)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InputError, match=r"holds \.metadata"):
        load_training_state(torch.load(out / "checkpoint.pt", weights_only=True), model, None,
                            torch.optim.AdamW(model.parameters()), None, out)
    assert not marker.exists()
