"""The training loop's batches through a torch DataLoader (adept_ext.training.loader): the order
the loop indexed before (`batches[((s·A + m)·W + r) mod n]`), whatever the number of loader
workers and the step a run resumes at; workers stop with the steps, also when a run is killed,
and share the data rather than copy it. --streaming through the loader: tests/test_large_corpus.py;
2 gloo ranks with loader workers: tests/test_distributed.py."""
import multiprocessing
import sys
from types import SimpleNamespace

import pytest
import torch
from test_continual import options as continual_options
from test_continual import quiet
from test_continual import workspace as continual_workspace  # noqa: F401 (module-scoped fixture)
from test_train import options, workspace  # noqa: F401 (module-scoped fixture)

import adept_ext.training.loop as loop_module
from adept_ext import data
from adept_ext.training.loader import batch_loader, micro_batch_order


def indexed(n, steps, grad_accum, world, rank, start=0):
    """The batch indices the loop read before it had a loader (its formula, kept as the definition)."""
    return [((s * grad_accum + m) * world + rank) % n for s in range(start, steps) for m in range(grad_accum)]


def numbered_batches(n, batch_size=2, length=5):
    """LazyBatches of n·batch_size blocks whose tokens say which block they are."""
    ids = torch.arange(n * batch_size).repeat_interleave(length).view(-1, length)
    blocks = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return data.BlockSet(data.TensorBlocks(blocks)).batches(batch_size)


def workers_left_by_train_steps(monkeypatch, interrupt_at=None):
    """`loop.train_steps` made to record the loader worker processes still alive when it returns or
    raises (the list returned), and, with `interrupt_at` = (call, step), to raise KeyboardInterrupt
    after that step of that call (a Ctrl-C inside a task)."""
    real, calls, alive = loop_module.train_steps, [], []

    def watched(*args, after_step, **kwargs):
        calls.append(1)

        def after(step):
            after_step(step)
            if (len(calls), step) == interrupt_at:
                raise KeyboardInterrupt
        try:
            return real(*args, after_step=after, **kwargs)
        finally:
            alive.extend(multiprocessing.active_children())
    monkeypatch.setattr(loop_module, "train_steps", watched)
    return alive


def test_ranks_take_disjoint_batches_that_together_are_one_process_order():
    """Under W ranks rank r takes r, r + W, …: disjoint, and together the order of one process with
    W times the micro-batches per step; a resumed run's order is the uninterrupted one's tail."""
    cfg = SimpleNamespace(steps=5, grad_accum=3)
    ranks = [list(micro_batch_order(0, cfg, 2, rank)) for rank in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    one = list(micro_batch_order(0, SimpleNamespace(steps=5, grad_accum=6), 1, 0))
    assert sorted(ranks[0] + ranks[1]) == one
    for rank in range(2):
        assert list(micro_batch_order(2, cfg, 2, rank)) == ranks[rank][2 * 3:]
        assert [i % 7 for i in ranks[rank]] == indexed(7, 5, 3, 2, rank)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_the_indexed_batches_with_any_number_of_workers(workers):
    batches = numbered_batches(7)
    cfg = SimpleNamespace(steps=6, grad_accum=2, dataloader_num_workers=workers)
    for world, rank, start in ((1, 0, 0), (1, 0, 4), (2, 1, 3)):
        got = list(batch_loader(batches, cfg, start, torch.device("cpu"), world, rank))
        want = indexed(len(batches), cfg.steps, cfg.grad_accum, world, rank, start)
        assert len(got) == len(want)
        for batch, i in zip(got, want):
            assert all(torch.equal(batch[k], batches[i][k]) for k in batch)
    assert not multiprocessing.active_children()  # the workers stopped with the loader


def test_the_loader_draws_nothing_from_the_runs_random_numbers():
    """A loader draws its workers' base seed from a generator of its own: the global one, which a
    checkpoint saves and dropout or a method draws from, is as it was (so the numbers of a run, and
    of a run resumed with a new loader, are those of the loop that indexed its batches)."""
    state = torch.get_rng_state()
    for workers in (0, 2):
        list(batch_loader(numbered_batches(3), SimpleNamespace(steps=2, grad_accum=1, dataloader_num_workers=workers),
                          0, torch.device("cpu"), 1, 0))
        assert torch.equal(torch.get_rng_state(), state)


class NotCopied(data.LazyBatches):
    """Batches that refuse to be pickled: what a worker started by spawn or forkserver would need."""

    def __reduce__(self):
        raise AssertionError("the batches were pickled for a worker")


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux")
def test_workers_share_the_batches_rather_than_receive_a_copy():
    """Forked workers, even where Python's default start method is another (forkserver: Linux from
    Python 3.14): a memory-mapped corpus is shared, never pickled whole into each worker."""
    batches = numbered_batches(5)
    batches = NotCopied(batches.blocks, batches.indices, batches.batch_size)
    default = multiprocessing.get_start_method()
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        got = list(batch_loader(batches, SimpleNamespace(steps=5, grad_accum=1, dataloader_num_workers=2), 0,
                                torch.device("cpu"), 1, 0))
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert all(torch.equal(batch["input_ids"], batches[i]["input_ids"]) for batch, i in zip(got, range(5)))


def test_a_killed_run_resumed_with_two_loader_workers_equals_the_uninterrupted_one(workspace, monkeypatch):  # noqa: F811
    """`adept-ext run` killed at step 3 (by Ctrl-C in the evaluation there) with 2 loader workers
    reading ahead, resumed from its checkpoint with 2 workers: the same training losses and final
    losses as one uninterrupted run with none; no worker outlives the interrupt."""
    import adept_ext.training.one_domain as one_domain
    from adept_ext.train import run

    full = run(options(workspace, "loader-full", steps=6, eval_every=3), progress=False, log=quiet)
    real_evaluate, calls = one_domain.evaluate, {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # base general, base domain, then the evaluation at step 3
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(one_domain, "evaluate", interrupting)
    alive = workers_left_by_train_steps(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run(options(workspace, "loader-killed", steps=6, eval_every=3, dataloader_num_workers=2), progress=False,
            log=quiet)
    assert not alive  # stopped when the steps were interrupted, not when the traceback is let go
    monkeypatch.setattr(one_domain, "evaluate", real_evaluate)
    resumed = run(options(workspace, "loader-killed", steps=6, eval_every=3, dataloader_num_workers=2, resume=True),
                  progress=False, log=quiet)
    assert [h["loss"] for h in resumed["history"]["train"]] == pytest.approx(
        [h["loss"] for h in full["history"]["train"]], rel=1e-5)
    assert resumed["final"] == pytest.approx(full["final"], rel=1e-5)


def test_a_killed_sequence_resumed_with_two_loader_workers_equals_the_uninterrupted_one(
        continual_workspace, monkeypatch):  # noqa: F811
    """`adept-ext continual` killed inside its second task, resumed with 2 loader workers: the
    training losses and scores of one uninterrupted sequence with none; no worker outlives a task."""
    from adept_ext.continual import run

    ws = continual_workspace
    full = run(continual_options(ws, "loader-whole", method="seq_lora", steps=4), progress=False, log=quiet)
    real = loop_module.train_steps
    alive = workers_left_by_train_steps(monkeypatch, interrupt_at=(2, 3))  # task 2, after its checkpoint at step 2
    with pytest.raises(KeyboardInterrupt):
        run(continual_options(ws, "loader-killed", method="seq_lora", steps=4, dataloader_num_workers=2),
            progress=False, log=quiet)
    assert not alive
    monkeypatch.setattr(loop_module, "train_steps", real)
    resumed = run(continual_options(ws, "loader-killed", method="seq_lora", steps=4, dataloader_num_workers=2,
                                    resume=True), progress=False, log=quiet)
    flat = lambda m: [v for row in m for v in row]  # noqa: E731
    losses = lambda report: [h["loss"] for h in flat(report["history"])]  # noqa: E731
    assert losses(resumed) == pytest.approx(losses(full), rel=1e-5)  # the scores hardly see two batches
    assert flat(resumed["matrix"]) == pytest.approx(flat(full["matrix"]), rel=1e-5)
    assert resumed["general_loss"] == pytest.approx(full["general_loss"], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
@pytest.mark.parametrize("workers", [0, 2])
def test_on_a_gpu_the_loader_pins_once(workers, monkeypatch):
    """On a GPU the loader hands the loop pinned batches (a worker's through its pinning thread)
    and `batch_to_device` copies them without pinning them again."""
    batches = numbered_batches(3)
    cfg = SimpleNamespace(steps=4, grad_accum=1, dataloader_num_workers=workers)
    got = list(batch_loader(batches, cfg, 0, torch.device("cuda"), 1, 0))
    assert all(v.is_pinned() for batch in got for v in batch.values())
    real_pin, pinned = torch.Tensor.pin_memory, []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(t) or real_pin(t, *a, **k))
    on_gpu = [loop_module.batch_to_device(batch, torch.device("cuda"), 100) for batch in got]
    assert not pinned
    for batch, i in zip(on_gpu, indexed(3, 4, 1, 1, 0)):
        assert all(v.is_cuda and torch.equal(v.cpu(), batches[i][k]) for k, v in batch.items())
    loop_module.batch_to_device(batches[0], torch.device("cuda"), 100)  # a batch of the caller's own: pinned here
    assert len(pinned) == 3
