"""GroupedAdamW: torch.optim.AdamW's arithmetic over every param group at once."""
import pytest
import torch
from conftest import cuda_only
from tiny_models import padded_batches, tiny_model

from adept_ext.adept.expand import expand_layers
from adept_ext.adept.lr import DecoupledLR, param_groups
from adept_ext.optim import GroupedAdamW
from adept_ext.adept.units import UnitImportance


def _groups(dtype, seed=0, device="cpu"):
    """Odd shapes, an empty tensor, several groups with their own lr and weight decay, one
    parameter without a gradient and one group of another dtype."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7,), (3, 5), (0,), (33, 2), (1,), (4, 4, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]
    other = torch.nn.Parameter(torch.randn(9, generator=gen).to(device, torch.float32 if dtype != torch.float32
                                                               else torch.bfloat16))
    groups = [{"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
              {"params": params[2:4], "lr": 3e-3, "weight_decay": 0.0},
              {"params": params[4:], "lr": 5e-2},
              {"params": [other], "lr": 2e-3, "weight_decay": 0.3}]
    return groups


def _copy(groups):
    return [{**g, "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]} for g in groups]


def _set_grads(groups, step):
    gen = torch.Generator().manual_seed(100 + step)
    for g in groups:
        for i, p in enumerate(g["params"]):
            p.grad = None if (g is groups[2] and i == 0) else torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("foreach", [None, True])
def test_bit_identical_to_torch_adamw_over_steps_and_schedules(dtype, foreach, device="cpu"):
    ours_groups = _groups(dtype, device=device)
    ref_groups = _copy(ours_groups)
    ours = GroupedAdamW(ours_groups, lr=1e-3, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_groups, lr=1e-3, weight_decay=0.05, foreach=foreach)
    for step in range(5):
        for opt, groups in ((ours, ours_groups), (ref, ref_groups)):
            _set_grads(groups, step)
            for g in opt.param_groups:
                g["lr"] *= 0.7  # a schedule changes the rates between steps
            opt.step()
    for a, b in zip(ours.param_groups, ref.param_groups):
        for p, q in zip(a["params"], b["params"]):
            # CPU for-loop AdamW: own fp16 rounding
            if foreach is None and device == "cpu" and p.dtype == torch.float16:
                torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-3)
                continue
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if q in ref.state:
                    assert torch.equal(ours.state[p][key], ref.state[q][key])
    assert ours.param_groups[2]["params"][0] not in ours.state  # never had a gradient: untouched, like AdamW


def test_updated_in_passes_of_bounded_size_still_bit_identical(monkeypatch):
    """The step's temporary √v covers one pass of at most `STEP_SLICE_NUMEL` elements: larger
    tensors are cut along their flat view, a non-contiguous one stays whole."""
    import adept_ext.optim as optim

    sizes = []
    update = optim._adamw_update
    monkeypatch.setattr(optim, "_adamw_update",
                        lambda p, g, m, v, *a: sizes.append([x.numel() for x in v]) or update(p, g, m, v, *a))
    monkeypatch.setattr(optim, "STEP_SLICE_NUMEL", 40)
    test_bit_identical_to_torch_adamw_over_steps_and_schedules(torch.float32, True)
    # 7 + 15 + 0, (33, 2) in 40 + 26, (4, 4, 3) in 40 + 8; the bfloat16 tensor in its own dtype
    assert sorted(sizes[:6]) == [[7, 15, 0], [8], [9], [26], [40], [40]] and len(sizes) == 6 * 5
    gen = torch.Generator().manual_seed(0)
    transposed = torch.randn(50, 3, generator=gen).t()  # not contiguous: one pass of 150 elements
    ours, ref = torch.nn.Parameter(transposed.clone().t().contiguous().t()), torch.nn.Parameter(transposed.clone())
    assert not ours.is_contiguous()
    optimizers = GroupedAdamW([ours], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2, foreach=True)
    for opt, p in zip(optimizers, (ours, ref)):
        for step in range(3):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
    assert sizes[-1] == [150] and torch.equal(ours, ref)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_identical_to_torch_adamw_on_cuda(dtype):
    """On a GPU torch's AdamW defaults to its multi-tensor path; GroupedAdamW matches it bit for bit."""
    test_bit_identical_to_torch_adamw_over_steps_and_schedules(dtype, None, device="cuda")


def test_state_dict_loads_into_and_from_torch_adamw():
    groups = _groups(torch.float32)
    ours = GroupedAdamW(groups)
    _set_grads(groups, 0)
    ours.step()
    ref = torch.optim.AdamW(_copy(groups))
    ref.load_state_dict(ours.state_dict())
    back = GroupedAdamW(_copy(groups))
    back.load_state_dict(ref.state_dict())
    assert back.state_dict()["state"].keys() == ours.state_dict()["state"].keys()


def test_unsupported_settings_are_clear_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="every group must share"):
        GroupedAdamW([{"params": [p]}, {"params": [q], "betas": (0.8, 0.99)}])
    opt = GroupedAdamW([p])
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    with pytest.raises(ValueError, match="(?i)tensor"):
        GroupedAdamW([p], lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="complex parameters"):
        GroupedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="has a tensor lr"):
        GroupedAdamW([p]).add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(1e-3)})


@pytest.mark.parametrize("other", [lambda ps: torch.optim.AdamW(ps, amsgrad=True), lambda ps: torch.optim.Adam(ps)])
def test_a_state_dict_it_cannot_step_as_adamw_is_refused_unloaded(other):
    p = torch.nn.Parameter(torch.ones(3))
    source = other([p])
    p.grad = torch.ones(3)
    source.step()
    ours = GroupedAdamW([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="amsgrad=True|Adam's"):
        ours.load_state_dict(source.state_dict())
    assert not ours.state and not ours.param_groups[0]["amsgrad"]


def test_decoupled_rates_ride_on_it_as_on_adamw():
    """DecoupledLR's per-unit multipliers through GroupedAdamW give AdamW's training, bit for bit."""
    results = []
    for cls in (GroupedAdamW, torch.optim.AdamW):
        model = tiny_model("llama", layers=3)
        expand_layers(model, [1])
        opt = cls(param_groups(model, 1e-3, weight_decay=0.01))
        decoupled = DecoupledLR(opt, UnitImportance(model, padded_batches(n_batches=1, seed=5)), every=2)
        for batch in padded_batches(n_batches=3):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
        assert decoupled.recomputes == 1
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
