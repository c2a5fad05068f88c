import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext.adept.expand import expand_layers
from adept_ext.adept.lr import DecoupledLR, param_groups
from adept_ext.adept.units import UnitImportance


def setup(lr=1e-3, every=2, floor=0.1, normalize="per_kind"):
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    opt = torch.optim.AdamW(param_groups(model, lr, weight_decay=0.01))
    imp = UnitImportance(model, padded_batches(n_batches=1), normalize=normalize)
    return model, opt, DecoupledLR(opt, imp, every=every, floor=floor)


def train_step(model, opt, batch):
    opt.zero_grad()
    model(**batch).loss.backward()
    opt.step()


def test_each_unit_gets_its_own_rate_in_the_update():
    model, opt, dec = setup(lr=1e-2)
    assert len(opt.param_groups) == len(dec.importance.units) == 22
    with torch.no_grad():  # fresh copies pass no gradient upstream of their zeroed outputs
        for i in (1, 4):
            model.model.layers[i].self_attn.o_proj.weight.normal_(0, 0.1)
            model.model.layers[i].mlp.down_proj.weight.normal_(0, 0.1)
    # SGD-like check through AdamW's first step: |Δθ| = lr_U for every element with g != 0
    before = [g["params"][0].detach().clone() for g in opt.param_groups]
    mult = dec.multipliers
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    train_step(model, opt, padded_batches(n_batches=1)[0])
    seen = set()
    for g, b, m in zip(opt.param_groups, before, mult):
        delta = (g["params"][0].detach() - b).abs()
        nz = delta[delta > 0]
        if nz.numel():
            torch.testing.assert_close(nz.median().item(), 1e-2 * m, rtol=1e-3, atol=1e-7)
            seen.add(round(m, 6))
    assert len(seen) > 5  # really many different rates, not two
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)  # scheduler-visible lr restored exactly


def test_multipliers_formula_floor_and_mean():
    _, _, dec = setup(floor=0.3)
    for s, m in zip(dec.scores, dec.multipliers):
        assert m == pytest.approx(max(2 * (1 - s), 0.3))
    assert min(dec.multipliers) >= 0.3
    _, _, rank = setup(normalize="rank", floor=0.0)
    assert rank.mean_multiplier == pytest.approx(1.0, abs=1e-9)


def test_composes_with_a_scheduler():
    model, opt, dec = setup(lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    batch = padded_batches(n_batches=1)[0]
    for step in range(3):
        assert all(g["lr"] == pytest.approx(1e-2 * 0.5 ** step) for g in opt.param_groups)
        rates = dec.rates()
        assert all(rates[u.name] == pytest.approx(1e-2 * 0.5 ** step * m)
                   for u, m in zip(dec.importance.units, dec.multipliers))
        train_step(model, opt, batch)
        sched.step()


def test_recompute_schedule_and_state_dict():
    model, opt, dec = setup(every=2)
    initial = list(dec.scores)
    batch = padded_batches(n_batches=1)[0]
    train_step(model, opt, batch)
    assert dec.recomputes == 0 and dec.scores == initial
    train_step(model, opt, batch)
    assert dec.recomputes == 1 and dec.scores != initial
    state = dec.state_dict()
    _, opt2, dec2 = setup(every=2)
    dec2.load_state_dict(state)
    assert dec2.scores == dec.scores and dec2.steps == 2 and dec2.multipliers == dec.multipliers


def test_no_recompute_after_the_last_step():
    model, opt, dec = setup(every=2)
    dec.last_step = 4
    batch = padded_batches(n_batches=1)[0]
    due = []
    for _ in range(4):
        due.append(dec.recompute_due())
        train_step(model, opt, batch)
    assert due == [False, True, False, False] and dec.recomputes == 1 and dec.steps == 4


def test_needs_one_group_per_unit():
    model = tiny_model("qwen3", layers=4)
    trainable = expand_layers(model, [0])
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    imp = UnitImportance(model, padded_batches(n_batches=1))
    with pytest.raises(ValueError, match="has no param group of its own"):
        DecoupledLR(opt, imp)
    with pytest.raises(ValueError, match="every"):
        DecoupledLR(torch.optim.AdamW(param_groups(model, 1e-3)), imp, every=0)


def test_rates_survive_optimizer_load_state_dict():
    # optimizer.load_state_dict replaces the param-group dicts: the multipliers must follow them
    model, opt, dec = setup(lr=1e-2)
    opt.load_state_dict(opt.state_dict())
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([g["lr"] for g in o.param_groups]))
    train_step(model, opt, padded_batches(n_batches=1)[0])  # DecoupledLR's hook runs first (registered first)
    assert [round(lr, 12) for lr in seen[0]] == [round(1e-2 * m, 12) for m in dec.multipliers]


def test_recompute_in_the_given_autocast_dtype():
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    opt = torch.optim.AdamW(param_groups(model, 1e-3))
    seen = []
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    try:
        plain = DecoupledLR(opt, UnitImportance(model, padded_batches(n_batches=1)))
        plain.remove()
        assert seen == [torch.float32]  # default: as before, fp32
        seen.clear()
        imp = UnitImportance(model, padded_batches(n_batches=1))
        dec = DecoupledLR(opt, imp, autocast_dtype=torch.bfloat16)  # the source scores, then a recompute
        dec.recompute()
        assert seen == [torch.bfloat16, torch.bfloat16]
        dec.remove()
        seen.clear()
        inherited = DecoupledLR(opt, UnitImportance(model, padded_batches(n_batches=1), autocast_dtype=torch.bfloat16))
        inherited.recompute()  # None: the importance's own setting
        assert seen == [torch.bfloat16, torch.bfloat16]
        inherited.remove()
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="autocast_dtype"):
        DecoupledLR(opt, imp, autocast_dtype=torch.int8)


def test_auto_recomputes_in_the_precision_the_training_forward_used():
    """The default "auto": each recompute runs under the autocast of the last training forward."""
    model = tiny_model("qwen3", layers=4)
    expand_layers(model, [0, 2])
    opt = torch.optim.AdamW(param_groups(model, 1e-3))
    dec = DecoupledLR(opt, UnitImportance(model, padded_batches(n_batches=1)), every=1)
    seen = []
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    batch = padded_batches(n_batches=1, seed=3)[0]
    try:
        for autocast, expected in ((torch.bfloat16, torch.bfloat16), (None, torch.float32)):
            model.train()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(**batch).loss
            seen.clear()
            loss.backward()
            opt.step()  # step_end recomputes (every=1) on the probe batch
            assert seen == [expected] and dec.training_autocast_dtype == autocast
    finally:
        handle.remove()
    assert dec.recomputes == 2
    dec.remove()
    assert not model._forward_pre_hooks  # remove() detaches the observer too


def test_a_step_that_raises_does_not_leave_or_compound_the_multipliers():
    model, opt, dec = setup(lr=1e-2, every=100)
    batch = padded_batches(n_batches=1)[0]
    calls = {"n": 0}

    def failing_once(optimizer, args, kwargs):  # runs after DecoupledLR's pre-hook, like a failing step
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("step failed")

    handle = opt.register_step_pre_hook(failing_once)
    opt.zero_grad()
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([g["lr"] for g in dec._groups]))
    opt.step()  # the next step multiplies the scheduler's rates once, not the multiplied ones again
    assert seen[0] == pytest.approx([1e-2 * m for m in dec.multipliers])
    assert all(g["lr"] == pytest.approx(1e-2) for g in opt.param_groups) and dec.steps == 1
    handle.remove()
    dec.step_begin()  # as a failed step leaves it; restore() puts the scheduler's rates back at once
    dec.restore()
    assert all(g["lr"] == pytest.approx(1e-2) for g in opt.param_groups)


def test_explicit_step_calls_for_optimizer_wrappers():
    model, opt_hooked, dec_hooked = setup(lr=1e-2, every=2)
    model2 = tiny_model("qwen3", layers=4)
    expand_layers(model2, [0, 2])
    opt = torch.optim.AdamW(param_groups(model2, 1e-2, weight_decay=0.01))
    dec = DecoupledLR(opt, UnitImportance(model2, padded_batches(n_batches=1), normalize="per_kind"), every=2,
                      hooks=False)
    batch = padded_batches(n_batches=1)[0]
    for _ in range(3):
        train_step(model, opt_hooked, batch)
        opt.zero_grad()
        model2(**batch).loss.backward()
        dec.step_begin()
        opt.step()
        dec.step_end()
    assert dec.steps == dec_hooked.steps == 3 and dec.recomputes == dec_hooked.recomputes == 1
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b)
