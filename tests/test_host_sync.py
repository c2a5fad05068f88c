"""Host synchronisations in the training steps: the loss stays on the device and is read once
every `--logging-steps` steps; a batch's labels are checked on the host before it goes there."""
import traceback
import warnings
from contextlib import contextmanager

import pytest
import torch
from conftest import DEVICES
from tiny_models import write_run_workspace

import adept_ext.training.loop as loop
from adept_ext.data import check_labels
from adept_ext.errors import InputError
from adept_ext.train import config_from, run

# A tensor's value read on the host: directly, by a copy to it, or by an op whose output's size
# depends on the values (nonzero, indexing with a boolean mask: `masked_index`).
READS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy", "nonzero", "__getitem__")


def masked_index(index) -> bool:
    """Whether a `__getitem__` index holds a boolean tensor (a mask: the result's size is read on the host)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)
# Reads made in these files are not counted: AdamW's step counts, which torch keeps on the host on
# every device (adept_ext/optim.py); transformers' mask preparation, which in every forward reads
# the attention mask (or, without one, the position ids) back from the device to choose SDPA's
# causal path (transformers 5's masking_utils: one per micro-batch, the Trainer's too, not the
# loop's to remove); torch's DataLoader, which reads its workers' base seed from a CPU generator
# once per task (the host's own tensor, counted here only on the CPU).
NOT_SYNCS = ("adept_ext/optim.py", "transformers/masking_utils.py", "torch/utils/data/dataloader.py")
# Functions whose reads are of host tensors by contract: `data.check_labels` reads a batch's labels
# as built on the host, before the batch goes to the device.
HOST_ONLY = ("check_labels",)
STEPS, LOGGING, ACCUM, EVERY = 11, 4, 4, 3  # logs at steps 4, 8, 11; evaluation, checkpoint, recompute at 3, 6, 9
LOGGED = [4, 8, 11]


class Syncs:
    """Counts, while `on`, the host reads of tensors (the patched `READS`; on a GPU only those of
    device tensors) and, on a GPU, the synchronisations `torch.cuda.set_sync_debug_mode` reports."""

    def __init__(self, monkeypatch, cuda: bool):
        self.cuda, self.active, self.reads, self.warned = cuda, False, [], []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self.counting(name, getattr(torch.Tensor, name)))

    def counting(self, name, real):
        def read(tensor, *args, **kwargs):
            if name == "__getitem__" and not masked_index(args[0]):
                return real(tensor, *args, **kwargs)
            if self.active and not (self.cuda and tensor.is_cpu):
                stack = traceback.extract_stack()[:-1]
                if not any(path in frame.filename for frame in stack for path in NOT_SYNCS) and \
                        not any(frame.name in HOST_ONLY for frame in stack):
                    self.reads.append(f"{name} at " + " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                                                  for f in reversed(stack[-4:])))
            return real(tensor, *args, **kwargs)
        return read

    @contextmanager
    def on(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.caught, self.active = caught, True
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                self.active = False
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")

    def take(self):
        """(host reads, device synchronisations) since the last call."""
        warned = [w for w in self.caught if "synchronizing CUDA operation" in str(w.message)
                  and not any(path in w.filename for path in NOT_SYNCS)]
        got = (self.reads, warned[len(self.warned):])
        self.reads, self.warned = [], warned
        return got


def tiny_run(ws, out, **options):
    cfg = config_from(dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"),
                           out=str(ws / out), k=2, max_length=32, batch_size=2, grad_accum=ACCUM, warmup_steps=1,
                           probe_blocks=4, eval_blocks=4, eval_every=EVERY, save_every=EVERY,
                           recompute_every=EVERY, lr=1e-3, **options))
    return run(cfg, progress=False, log=lambda *a: None)


def counted_run(ws, out, monkeypatch, device, **options):
    """`tiny_run` on `device`; returns (report, {step: (host reads, device syncs) of the step,
    its evaluation and checkpoint included})."""
    syncs, per_step, real = Syncs(monkeypatch, device == "cuda"), {}, loop.train_steps

    def counted(*args, after_step, **kwargs):
        def after(step):
            after_step(step)
            per_step[step] = syncs.take()
        with syncs.on():
            return real(*args, after_step=after, **kwargs)

    monkeypatch.setattr(loop, "train_steps", counted)
    return tiny_run(ws, out, device=device, **options), per_step


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("sync"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["lora", "adept"])
def test_one_host_sync_per_logging_steps(workspace, monkeypatch, method, device):
    """--logging-steps 4 --grad-accum 4 (and --report-to tensorboard: the grad norm is read too): no
    step reads a tensor on the host but the steps that log (4, 8 and the last, 11), which read
    once; evaluation, checkpoint and recompute steps (3, 6, 9) may."""
    report, per_step = counted_run(workspace, f"{method}-{device}", monkeypatch, device, method=method, steps=STEPS,
                                   logging_steps=LOGGING, report_to="tensorboard")
    assert sorted(per_step) == list(range(1, STEPS + 1))
    logged = [h["step"] for h in report["history"]["train"]]
    assert logged == LOGGED
    for step, (reads, synced) in per_step.items():
        if step % EVERY:
            allowed = 1 if step in logged else 0
            assert len(reads) <= allowed, f"step {step}: {reads}"
            assert len(synced) <= allowed, f"step {step}: {[str(w.message) for w in synced]}"


PLANTED_READS = {"float": float, "cpu": lambda t: t.cpu(), "numpy": lambda t: t.numpy(),
                 "nonzero": lambda t: t[None].nonzero(), "mask": lambda t: t[None][t[None] > 0]}


@pytest.mark.parametrize("read", PLANTED_READS)
def test_the_count_catches_a_read_per_micro_batch(workspace, monkeypatch, read):
    """A planted read of the loss in every micro-batch (a value, a copy to the host, an op whose
    output size depends on the values) shows in every step's count."""
    from adept_ext.methods.base import Method

    real_loss = Method.loss

    def reading(self, *args, **kwargs):
        loss = real_loss(self, *args, **kwargs)
        PLANTED_READS[read](loss.detach())
        return loss

    monkeypatch.setattr(Method, "loss", reading)
    _, per_step = counted_run(workspace, f"planted-{read}", monkeypatch, "cpu", method="lora", steps=2,
                              logging_steps=LOGGING)
    assert [len(reads) for reads, _ in per_step.values()] == [ACCUM, ACCUM + 1]  # step 2: the last, which logs


def test_logging_steps_log_the_mean_since_the_last_log(workspace):
    """Hugging Face's logging: at step 4, 8 and the last (11) the mean loss of the steps since the
    previous entry, with that step's lr; --logging-steps 1 logs every step's own loss."""
    every = tiny_run(workspace, "every-step", method="lora", steps=STEPS)
    fourth = tiny_run(workspace, "every-fourth", method="lora", steps=STEPS, logging_steps=LOGGING)
    steps = every["history"]["train"]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    assert [h["step"] for h in fourth["history"]["train"]] == LOGGED
    for entry, (first, last) in zip(fourth["history"]["train"], [(0, 4), (4, 8), (8, 11)]):
        assert entry["step"] == last and entry["lr"] == steps[last - 1]["lr"]
        assert entry["loss"] == pytest.approx(sum(h["loss"] for h in steps[first:last]) / (last - first), rel=1e-12)
    assert every["final"] == fourth["final"]  # logging changes no step


def test_labels_are_checked_on_the_host_before_the_device():
    """The fused loss does not read its targets back from a GPU: a batch's labels are checked on
    the host as it goes to the device."""
    ids = torch.tensor([[5, 6, 96], [0, 97, 3]])
    good = {"input_ids": ids, "labels": ids.masked_fill(ids == 97, -100)}
    assert torch.equal(loop.batch_to_device(good, torch.device("cpu"), 97)["labels"], good["labels"])
    with pytest.raises(InputError, match=r"labels\[1, 1\] = 97 is outside the model's vocabulary \[0, 97\)"):
        loop.batch_to_device({"input_ids": ids, "labels": ids}, torch.device("cpu"), 97)
    with pytest.raises(ValueError, match=r"labels\[0, 0\] = -1 "):
        check_labels({"labels": torch.tensor([[-1]])}, 97)
