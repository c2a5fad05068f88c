"""`--optim`: bitsandbytes' 8-bit AdamW (adept_ext.optim.make_optimizer) against AdamW, with
per-group and per-unit rates, end to end through `adept-ext run`, across a kill and --resume, and
its refusals. bitsandbytes' CPU backend runs them all."""
import json

import pytest
import torch

pytest.importorskip("bitsandbytes")

from tiny_models import padded_batches, tiny_model, write_run_workspace  # noqa: E402

import adept_ext.optim as optim  # noqa: E402
import adept_ext.training.loop as loop  # noqa: E402
from adept_ext.cli import main  # noqa: E402
from adept_ext.errors import RunError  # noqa: E402
from adept_ext.adept.expand import expand_layers  # noqa: E402
from adept_ext.adept.lr import DecoupledLR, param_groups  # noqa: E402
from adept_ext.optim import OPTIMIZERS, make_optimizer, moment_bytes, state_bytes  # noqa: E402
from adept_ext.train import config_from, run  # noqa: E402
from adept_ext.adept.units import UnitImportance  # noqa: E402

EIGHT_BIT = [name for name in OPTIMIZERS if name != "adamw_torch"]
pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_run_workspace(tmp_path_factory.mktemp("optim8"))


# bitsandbytes' CUDA kernels on a GPU (tools/gpu_check.sh runs the [cuda] cases with the carried wheel).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a GPU (tools/gpu_check.sh runs it)"))]


def _params(seed=0, device="cpu"):
    """Two tensors of at least MIN_8BIT_SIZE elements (8-bit moments) and one smaller (float32 moments),
    drawn on the host (the same values on every device)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((64, 128), (4096,), (33, 5))]


def _step(opt, params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("device", DEVICES)
def test_steps_follow_adamw_with_8bit_moments(name, device):
    """20 steps of a schedule: the weights' change is AdamW's within 5 % (norm of the difference over the
    norm of AdamW's change; fixed before the first run: the moments' blockwise 8-bit codes err by about 1 %
    each step; the same bound for bitsandbytes' CUDA kernels, which implement the same blockwise update),
    the moments of the large tensors are uint8 codes with float32 block scales on the parameters' device,
    and the state is about 2 bytes per parameter of those tensors against AdamW's 8."""
    ours_params, ref_params = _params(device=device), _params(device=device)
    ours = make_optimizer(name, [{"params": ours_params}], lr=1e-3, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.05)
    start = [p.detach().clone() for p in ref_params]
    for step in range(20):
        for opt, params in ((ours, ours_params), (ref, ref_params)):
            for g in opt.param_groups:
                g["lr"] = 1e-3 * (1 - step / 20)
            _step(opt, params, step)
    for p, q, p0 in zip(ours_params, ref_params, start):
        error = ((p - q).norm() / (q - p0).norm()).item()
        assert error < 0.05, (tuple(p.shape), error)
    assert ours.is_paged == name.startswith("paged_")
    big, other, small = (ours.state[p] for p in ours_params)
    for state in (big, other):
        assert state["state1"].dtype == state["state2"].dtype == torch.uint8
        assert state["absmax1"].dtype == torch.float32
        assert state["state1"].device.type == state["absmax1"].device.type == device
        assert state["absmax1"].numel() == -(-state["state1"].numel() // 256)
    assert small["state1"].dtype == torch.float32  # under MIN_8BIT_SIZE: float32, as bitsandbytes and HF do
    # two uint8 moments and two float32 scales per block of 256, the two 256-entry float32 maps (shared),
    # and the small tensor's two float32 moments
    blocks = sum(-(-p.numel() // 256) for p in ours_params[:2])
    n_big = sum(p.numel() for p in ours_params[:2])
    assert state_bytes(ours) == 2 * n_big + 2 * 4 * blocks + 2 * 256 * 4 + 2 * 4 * ours_params[2].numel()
    assert moment_bytes(name) * n_big == 2 * n_big + 2 * 4 * blocks and moment_bytes("adamw_torch") == 8
    assert state_bytes(ref) >= 8 * sum(p.numel() for p in ref_params)


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_each_group_steps_at_its_own_rate(name):
    """Three copies of one tensor with the same gradients: lr 0 leaves it, twice the lr moves it twice as far
    (from zero, so that the moves are not lost in the rounding of large weights)."""
    params = [torch.nn.Parameter(torch.zeros(64, 128)) for _ in range(3)]
    opt = make_optimizer(name, [{"params": [params[0]], "lr": 0.0}, {"params": [params[1]]},
                                {"params": [params[2]], "lr": 2e-3}], lr=1e-3, weight_decay=0.0)
    start = params[0].detach().clone()
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grad = torch.randn(start.shape, generator=gen)
        for p in params:
            p.grad = grad.clone()
        opt.step()
    assert torch.equal(params[0], start)
    assert opt.state[params[0]]["state1"].dtype == torch.uint8
    torch.testing.assert_close(params[2] - start, 2 * (params[1] - start), rtol=1e-4, atol=1e-7)


def test_adepts_per_unit_rates_are_honoured(monkeypatch):
    """DecoupledLR's multipliers ride on the 8-bit optimizer's step hooks: on the first step Adam moves
    every element by its rate (m̂/√v̂ = ±1), so each unit's median move over lr is its multiplier
    (within 10 %, 8-bit moments), and the groups hold the scheduled rate again after the step."""
    monkeypatch.setattr(optim, "MIN_8BIT_SIZE", 1)  # the tiny model's tensors in 8 bits too
    torch.manual_seed(0)
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    opt = make_optimizer("adamw_8bit", param_groups(model, 1e-3, weight_decay=0.0), lr=1e-3, weight_decay=0.0)
    decoupled = DecoupledLR(opt, UnitImportance(model, padded_batches(n_batches=1, seed=5)), every=100)
    multiplier = {u.name: m for u, m in zip(decoupled.importance.units, decoupled.multipliers)}
    params = {g["adept_unit"]: g["params"][0] for g in opt.param_groups}
    before = {name: p.detach().clone() for name, p in params.items()}
    model(**padded_batches(n_batches=1)[0]).loss.backward()
    opt.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-3] * len(params)
    checked = set()
    for name, p in params.items():
        assert opt.state[p]["state1"].dtype == torch.uint8
        has_grad = p.grad.abs() > 1e-6
        if has_grad.sum() < 16:  # a fresh copy's unit behind a zero output projection: no gradient yet
            continue
        ratio = (p - before[name]).abs()[has_grad].median().item() / (1e-3 * multiplier[name])
        assert 0.9 < ratio < 1.1, (name, multiplier[name], ratio)
        checked.add(round(multiplier[name], 3))
    assert len(checked) >= 2 and max(checked) > 1.5 * min(checked), checked  # rates that differ, each honoured


def _options(ws, out, **kw):
    base = dict(model=str(ws / "tiny"), general=str(ws / "general"), domain=str(ws / "domain.jsonl"), out=str(ws / out),
                k=2, max_length=32, batch_size=2, steps=6, warmup_steps=1, probe_blocks=4, eval_blocks=4, eval_every=3,
                save_every=2, recompute_every=2, lr=1e-3, optim="adamw_8bit")
    base.update(kw)
    return config_from(base)


@pytest.fixture
def optimizers(monkeypatch):
    """Every tensor's moments in 8 bits (the tiny model's are under MIN_8BIT_SIZE); the optimizers the runs build."""
    monkeypatch.setattr(optim, "MIN_8BIT_SIZE", 1)
    built, real = [], loop.optimizer_for

    def spy(task, cfg):
        optimizer, scheduler = real(task, cfg)
        built.append(optimizer)
        return optimizer, scheduler

    monkeypatch.setattr(loop, "optimizer_for", spy)
    return built


def test_cli_run_lora_with_adamw_8bit(workspace, optimizers):
    out = workspace / "lora-8bit"
    assert main(["run", "--model", str(workspace / "tiny"), "--general", str(workspace / "general"),
                 "--domain", str(workspace / "domain.jsonl"), "--max-length", "32", "--batch-size", "2", "--steps", "4",
                 "--probe-blocks", "4", "--eval-blocks", "4", "--lr", "1e-3", "--method", "lora",
                 "--optim", "adamw_8bit", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["optim"] == "adamw_8bit"
    assert report["final"]["domain_loss"] < report["base"]["domain_loss"]
    (opt,) = optimizers
    assert type(opt).__name__ == "AdamW8bit" and opt.state
    assert all(s["state1"].dtype == s["state2"].dtype == torch.uint8 for s in opt.state.values())


def test_kill_and_resume_with_8bit_state_equals_the_uninterrupted_run(workspace, monkeypatch, optimizers):
    """ADEPT (per-unit groups and rates) with adamw_8bit, killed at step 3 and resumed (test_train.py's
    test): the checkpoint holds the uint8 moments and their scales, loaded with weights_only=True, and the
    resumed run ends as the uninterrupted one."""
    from test_train import test_resume_after_interrupt_gives_the_same_result as resume_test

    import adept_ext.train as train_module

    loaded, real_read = [], train_module.read_checkpoint
    monkeypatch.setattr(train_module, "read_checkpoint", lambda out: loaded.append(real_read(out)) or loaded[-1])
    resume_test(workspace, monkeypatch, "adept", False, {"optim": "adamw_8bit"})
    (checkpoint,) = loaded
    saved = list(checkpoint["optimizer"]["state"].values())
    assert saved and all(s["__bnb_optimizer_quant_state__"]["state1"].dtype == torch.uint8 for s in saved)
    assert len(optimizers) == 3 and all(s["state1"].dtype == torch.uint8 for s in optimizers[-1].state.values())


def test_refusals_before_anything_is_written(workspace, monkeypatch):
    with pytest.raises(RunError, match="optim must be one of adamw_torch, adamw_8bit"):
        config_from({"optim": "adamw_4bit"})
    import adept_ext.parallel

    monkeypatch.setattr(adept_ext.parallel, "launched_world", lambda: 2)
    with pytest.raises(RunError, match="--optim paged_adamw_8bit with --parallel fsdp2 is not supported"):
        config_from({"optim": "paged_adamw_8bit", "parallel": "fsdp2"})
    config_from({"parallel": "fsdp2"})  # AdamW shards as before
    real_find_spec = optim.importlib.util.find_spec
    monkeypatch.setattr(optim.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    with pytest.raises(RunError, match=r"not installed: pip install 'adept-ext\[quantization\]'"):
        run(_options(workspace, "no-bnb"), progress=False, log=lambda *a: None)
    assert not (workspace / "no-bnb").exists()
    assert config_from({}).optim == "adamw_torch"  # the default needs nothing


def test_the_runs_keep_the_embedding_weights_moments_in_float32():
    """As Hugging Face's Trainer does for 8-bit bitsandbytes optimizers (8-bit embedding moments are unstable)."""
    from types import SimpleNamespace

    model = torch.nn.Sequential(torch.nn.Embedding(512, 16), torch.nn.Linear(16, 512))
    task = SimpleNamespace(model=model, param_groups=[{"params": list(model.parameters())}], attach=lambda opt: None)
    cfg = SimpleNamespace(optim="adamw_8bit", lr=1e-3, weight_decay=0.0, warmup_steps=0, steps=2)
    opt, _ = loop.optimizer_for(task, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[model[0].weight]["state1"].dtype == torch.float32
    assert opt.state[model[1].weight]["state1"].dtype == torch.uint8
