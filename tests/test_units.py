import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext import reference, taylor_importance
from adept_ext.adept.expand import expand_layers
from adept_ext.adept.units import UnitImportance, mean_importance, normalize_scores, partition


def expanded(arch="qwen3", layers=4, copies=(0, 2)):
    model = tiny_model(arch, layers=layers)
    expand_layers(model, list(copies))
    return model


def test_per_tensor_and_per_unit_means_over_batches():
    sizes = [(4, 3), (5,), (2, 2)]
    sums = torch.zeros(3, 2)
    exact = torch.zeros(3, 2, dtype=torch.float64)
    for _ in range(3):
        params = [torch.randn(s) for s in sizes]
        grads = [torch.randn(s) for s in sizes]
        taylor_importance(params, grads, out=sums, accumulate=True)
        exact += reference.taylor_importance(params, grads)
    numels = [12, 5, 4]
    per_tensor = mean_importance(sums, numels, num_batches=3)
    torch.testing.assert_close(per_tensor.double(), exact / torch.tensor(numels)[:, None] / 3, rtol=1e-5, atol=1e-6)
    per_unit = mean_importance(sums, numels, groups=[1, 0, 1], num_batches=3)
    expect = torch.stack([exact[1] / 5, (exact[0] + exact[2]) / 16]) / 3
    torch.testing.assert_close(per_unit.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(numels=[1]), "2 rows of sums but 1 numels"),
    (dict(numels=[1, 1], groups=[0]), "1 group indices"),
    (dict(numels=[1, 1], groups=[0, -1]), "negative group"),
    (dict(numels=[1, 1], groups=[0, 2]), "group 1 has no elements"),
    (dict(numels=[0, 1]), "group 0 has no elements"),
    (dict(numels=[1, 1], num_batches=0), "num_batches"),
])
def test_mean_importance_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mean_importance(torch.zeros(2, 2), **kwargs)


def test_partition_qwen3_and_qwen2():
    units = partition(expanded("qwen3"))
    kinds = {u.name.split(".", 3)[3]: u.kind for u in units if u.layer == 1}
    assert kinds["self_attn.q_norm.weight"] == "norm" and kinds["self_attn.k_norm.weight"] == "norm"
    assert kinds["self_attn.o_proj.weight"] == "attention" and kinds["mlp.down_proj.weight"] == "mlp"
    assert kinds["input_layernorm.weight"] == "norm" and len(kinds) == 11
    assert {(u.layer, u.source_layer) for u in units} == {(1, 0), (4, 3)}
    assert all(u.source_name.replace(f".{u.source_layer}.", f".{u.layer}.", 1) == u.name for u in units)
    qwen2 = partition(expanded("qwen2"))
    assert sum(1 for u in qwen2 if u.layer == 1 and u.name.endswith("bias")) == 3  # q/k/v biases


def test_partition_needs_expanded_layers():
    with pytest.raises(ValueError, match="no expanded layers"):
        partition(tiny_model("llama"))


def naive_unit_scores(model, batches, names, mode):
    """Plain PyTorch: per-unit mean over batches of mean(|θ⊙g_b|) (or signed)."""
    params = dict(model.named_parameters())
    flags = {n: params[n].requires_grad for n in names}
    for n in names:
        params[n].requires_grad_(True)
    totals = torch.zeros(len(names), dtype=torch.float64)
    for batch in batches:
        grads = torch.autograd.grad(model(**batch).loss, [params[n] for n in names])
        for i, (n, g) in enumerate(zip(names, grads)):
            x = params[n].detach().double() * g.double()
            totals[i] += (x.abs() if mode == "abs" else x).mean()
    for n, f in flags.items():
        params[n].requires_grad_(f)
    return (totals / len(batches)).tolist()


@pytest.mark.parametrize("mode", ["abs", "signed"])
def test_scores_match_naive_and_leave_grads_untouched(mode):
    model = expanded()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 7.0)
    batches = padded_batches()
    imp = UnitImportance(model, batches, mode=mode)
    got = imp.raw_scores()
    want = naive_unit_scores(model, batches, [u.name for u in imp.units], mode)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-4, atol=1e-9)
    assert all((p.grad == 7).all() for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_fresh_copies_score_zero_so_sources_are_used():
    model = expanded()
    imp = UnitImportance(model, padded_batches())
    fresh = imp.raw_scores()
    by_name = dict(zip([u.name for u in imp.units], fresh))
    assert all(v == 0 for n, v in by_name.items() if "o_proj" in n or "down_proj" in n)
    source = imp.raw_scores(use_source=True)
    assert all(v > 0 for v in source)
    frozen = [p.requires_grad for p in model.parameters()]
    imp.compute(use_source=True)
    assert [p.requires_grad for p in model.parameters()] == frozen


def test_normalizations():
    scores, kinds = [1.0, 3.0, 2.0, 10.0, 20.0], ["mlp", "mlp", "mlp", "norm", "norm"]
    assert normalize_scores(scores, kinds, "per_kind") == [0.0, 1.0, 0.5, 0.0, 1.0]
    assert normalize_scores(scores, kinds, "global") == pytest.approx([0, 2 / 19, 1 / 19, 9 / 19, 1])
    assert normalize_scores(scores, kinds, "rank") == [0.0, 1.0, 0.5, 0.0, 1.0]
    assert normalize_scores([5.0, 5.0], ["mlp", "mlp"]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="normalize"):
        normalize_scores(scores, kinds, "zscore")


def test_non_finite_gradient_names_the_unit():
    model = expanded()
    imp = UnitImportance(model, padded_batches())
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite"):
        imp.raw_scores()


def test_bad_arguments():
    model = expanded()
    with pytest.raises(ValueError, match="mode"):
        UnitImportance(model, padded_batches(), mode="square")
    with pytest.raises(ValueError, match="probe data is empty"):
        UnitImportance(model, [])


def record_forward_dtypes(model):
    """Output dtypes of every Linear call (a forward hook); returns (list, handles)."""
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return seen, handles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_dtype_runs_the_probe_in_that_precision(dtype):
    model = expanded()
    batches = padded_batches()
    fp32 = UnitImportance(model, batches)
    low = UnitImportance(model, batches, autocast_dtype=dtype)
    seen, handles = record_forward_dtypes(model)
    try:
        want = fp32.raw_scores()
        assert set(seen) == {torch.float32}  # default: no autocast, as before
        seen.clear()
        got = low.raw_scores()
        assert set(seen) == {dtype}
        seen.clear()
        assert fp32.raw_scores(autocast_dtype=dtype) == got  # per-call override
        assert low.raw_scores(autocast_dtype=torch.float32) == want  # float32 = no autocast, bit-identical
    finally:
        for h in handles:
            h.remove()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights untouched
    # the same scores up to the low precision's rounding (the fresh copies score 0: use the sources)
    got, want = low.raw_scores(use_source=True), fp32.raw_scores(use_source=True)
    err = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert 0 < err < 0.1, err


def test_autocast_dtype_is_checked():
    with pytest.raises(ValueError, match="autocast_dtype"):
        UnitImportance(expanded(), padded_batches(), autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="autocast_dtype"):
        UnitImportance(expanded(), padded_batches()).raw_scores(autocast_dtype="bf16")


def test_a_unit_without_gradient_is_an_error_not_the_highest_rate():
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    model.model.layers[2].mlp.forward = lambda x: torch.zeros_like(x)  # the copy's MLP and its norm: no gradient
    imp = UnitImportance(model, padded_batches(n_batches=1))
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.gate_proj.weight \(and 3 more\) receives no gradient"):
        imp.compute()
    assert all(p.requires_grad == (".2." in n) for n, p in model.named_parameters())  # flags restored


def test_a_unit_scoring_exactly_zero_is_reported_not_silent():
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    imp = UnitImportance(model, padded_batches(n_batches=1))
    with pytest.warns(UserWarning, match=r"scores exactly 0 .* use_source=True"):
        scores = imp.raw_scores()  # the fresh copy: θ = 0 in o_proj/down_proj, ∇ = 0 upstream of them
    assert imp.zero_units == [u.name for u in imp.units] and scores == [0.0] * len(imp.units)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(s > 0 for s in imp.raw_scores(use_source=True))
    assert imp.zero_units == []
