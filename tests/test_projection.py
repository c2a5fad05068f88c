"""Null-space projection ops against reference.py, GradientMemory/GramMemory and NullSpaceProjector."""
import math

import pytest
import torch

from adept_ext import reference
from adept_ext.ops import conflict_correct_, null_space_apply_, null_space_coeffs
from adept_ext.projection import GradientMemory, GramMemory, NullSpaceProjector

SHAPES = [(5, 7), (0,), (9000,), (3,), (2, 3, 4)]


def flat(ts):
    return torch.cat([t.detach().double().reshape(-1).cpu() for t in ts])


def rand_list(shapes, device, dtype=torch.float32):
    return [torch.randn(s, device=device).to(dtype) for s in shapes]


def orthonormal_basis(shapes, k, device, dtype=torch.float32):
    n = sum(math.prod(s) for s in shapes)
    q, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64))
    rows, out, start = q.T, [], 0
    for s in shapes:
        m = math.prod(s)
        out.append(rows[:, start:start + m].reshape(k, *s).to(device=device, dtype=dtype))
        start += m
    return out


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [0, 1, 7, 64])
def test_coeffs_and_apply_match_reference(device, gdtype, k):
    basis = orthonormal_basis(SHAPES, k, device) if k else [torch.zeros(0, *s, device=device) for s in SHAPES]
    grads = rand_list(SHAPES, device, gdtype)
    c = null_space_coeffs(basis, grads)
    want_c = reference.null_space_coeffs(basis, grads)
    assert c.dtype == torch.float64 and c.shape == (k,)
    torch.testing.assert_close(c.cpu(), want_c, rtol=1e-5, atol=1e-5 * flat(grads).norm().item())
    want = reference.null_space_project(basis, grads)
    null_space_apply_(basis, grads, c)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[gdtype]
    assert (flat(grads) - torch.cat([w.reshape(-1) for w in want])).abs().max() <= tol * (1 + want_c.norm())
    if gdtype == torch.float32 and k:  # projected gradients are orthogonal to the basis
        residual = reference.null_space_coeffs(basis, grads).norm()
        assert residual <= 1e-6 * flat(want).norm() * 10 + 1e-6 * want_c.norm()


def test_many_tensors(device):
    shapes = [(int(s),) for s in torch.randint(0, 50, (2000,)).tolist()]
    basis, grads = orthonormal_basis(shapes, 5, device), rand_list(shapes, device)
    c = null_space_coeffs(basis, grads)
    torch.testing.assert_close(c.cpu(), reference.null_space_coeffs(basis, grads), rtol=1e-5, atol=1e-5)
    want = reference.null_space_project(basis, grads)
    null_space_apply_(basis, grads, c)
    torch.testing.assert_close(flat(grads), torch.cat([w.reshape(-1) for w in want]), rtol=1e-5, atol=1e-5)


def test_bf16_basis(device):
    basis = orthonormal_basis(SHAPES, 4, device, torch.bfloat16)
    grads = rand_list(SHAPES, device)
    c = null_space_coeffs(basis, grads)
    torch.testing.assert_close(c.cpu(), reference.null_space_coeffs(basis, grads), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_conflict_correct_matches_reference(device, sign):
    a = rand_list(SHAPES, device)
    b = [sign * x + 0.3 * torch.randn_like(x) for x in a]
    want, coef = reference.conflict_correct(a, b, lam=0.7, eps=1e-6)
    stats = conflict_correct_(a, b, lam=0.7, eps=1e-6)
    assert (coef != 0) == (sign < 0)
    assert stats[3].item() == pytest.approx(coef, rel=1e-5)
    torch.testing.assert_close(flat(a), torch.cat([w.reshape(-1) for w in want]), rtol=1e-5, atol=1e-5)


def test_conflict_correct_removes_the_conflicting_component(device):
    a = rand_list(SHAPES, device)
    b = [-x for x in a]
    conflict_correct_(a, b, lam=0.0)
    assert flat(a).norm() <= 1e-5 * flat(b).norm()  # g_new was entirely along −g_pre


def test_opcheck(device):
    basis, grads = orthonormal_basis(SHAPES, 3, device), rand_list(SHAPES, device)
    torch.library.opcheck(torch.ops.adept_ext.null_space_coeffs.default, (basis, grads))
    c = null_space_coeffs(basis, grads)
    torch.library.opcheck(torch.ops.adept_ext.null_space_apply_.default, (basis, grads, c))
    torch.library.opcheck(torch.ops.adept_ext.conflict_correct_.default, (grads, rand_list(SHAPES, device), 1.0, 1e-6))


@pytest.mark.parametrize("call,exc,match", [
    (lambda q, g: null_space_coeffs(q[:2], g), ValueError, "2 basis tensors but 5 grads"),
    (lambda q, g: null_space_coeffs([q[0], q[1][:1]] + q[2:], g), ValueError, r"basis\[1\] has shape"),
    (lambda q, g: null_space_coeffs(q, g[:1] + [g[1].double()] + g[2:]), TypeError, r"grads\[1\] has dtype"),
    (lambda q, g: null_space_coeffs([q[0].half()] + q[1:], g), TypeError, r"basis\[0\] has dtype"),
    (lambda q, g: null_space_coeffs(q, g[:1] + [None] + g[2:]), ValueError, r"grads\[1\] is None"),
    (lambda q, g: null_space_coeffs(q, g[:1] + [g[1].to("meta")] + g[2:]), ValueError, r"grads\[1\] is on meta"),
    (lambda q, g: null_space_apply_(q, g, torch.zeros(3)), ValueError, "float64"),
    (lambda q, g: null_space_apply_(q, [g[0].t()] + g[1:], torch.zeros(2, dtype=torch.float64)), ValueError, "contiguous"),
    (lambda q, g: conflict_correct_(g, g[:2]), ValueError, "equal length"),
    (lambda q, g: conflict_correct_(g, [g[1]] + g[1:]), ValueError, r"g_new\[0\] has shape"),
])
def test_op_errors(call, exc, match):
    basis, grads = orthonormal_basis(SHAPES, 2, "cpu"), rand_list(SHAPES, "cpu")
    before = [g.clone() for g in grads]
    with pytest.raises(exc, match=match):
        call(basis, grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))


# ---- GradientMemory / GramMemory ----

def make_params(device="cpu"):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(6, 5), (40,), (0,), (3, 2)]]


def test_memory_gram_schmidt_orthonormal_and_projection(device):
    params = make_params(device)
    mem = GradientMemory(params, max_directions=8)
    dirs = [[torch.randn_like(p) for p in params] for _ in range(5)]
    report = mem.add(dirs)
    assert report["added"] == [0, 1, 2, 3, 4] and mem.k == 5
    q = torch.stack([flat([b[j] for b in mem.basis]) for j in range(5)])
    torch.testing.assert_close(q @ q.T, torch.eye(5, dtype=torch.float64), atol=1e-6, rtol=0)
    g = [torch.randn_like(p) for p in params]
    norm = flat(g).norm()
    mem.project_(g)
    assert mem.orthogonality_error(g) <= 1e-6 and (q @ flat(g)).norm() <= 1e-6 * norm


def test_bfloat16_basis_memory(device):
    params = make_params(device)
    mem = GradientMemory(params, max_directions=6, dtype=torch.bfloat16)
    mem.add([[torch.randn_like(p) for p in params] for _ in range(6)])
    assert mem.basis[0].dtype == torch.bfloat16 and mem.k == 6
    g = [torch.randn_like(p) for p in params]
    mem.project_(g)
    assert mem.orthogonality_error(g) <= 2 ** -9  # bfloat16 rounding of the rows (76 elements here)


def test_dependent_and_zero_directions_are_dropped_and_reported(device):
    params = make_params(device)
    mem = GradientMemory(params, max_directions=8)
    d1 = [torch.randn_like(p) for p in params]
    d2 = [torch.randn_like(p) for p in params]
    combo = [2 * a - 3 * b for a, b in zip(d1, d2)]
    zero = [torch.zeros_like(p) for p in params]
    report = mem.add([d1, d2, combo, zero])
    assert report["added"] == [0, 1] and report["dropped"] == [2, 3] and mem.k == 2


def test_full_memory_is_an_error_unless_svd_policy():
    params = make_params()
    mem = GradientMemory(params, max_directions=2)
    mem.add([[torch.randn_like(p) for p in params] for _ in range(2)])
    with pytest.raises(ValueError, match="full"):
        mem.add([torch.randn_like(p) for p in params])
    assert mem.k == 2
    svd = GradientMemory(params, max_directions=2, policy="svd")
    small = [0.01 * torch.randn_like(p) for p in params]
    big = [10 * torch.randn_like(p) for p in params]
    svd.add([[torch.randn_like(p) for p in params], small])
    report = svd.add(big)
    assert report["replaced"] == [1] and svd.k == 2  # the weakest direction made room
    assert svd.add([0.001 * torch.randn_like(p) for p in params])["dropped"] == [0]


def test_memory_errors_and_state_dict():
    params = make_params()
    mem = GradientMemory(params, max_directions=3)
    with pytest.raises(ValueError, match="needs 4 tensors"):
        mem.add([torch.randn(2)])
    bad = [torch.randn_like(p) for p in params]
    bad[0][0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        mem.add(bad)
    assert mem.k == 0
    mem.add([torch.randn_like(p) for p in params])
    grads = [torch.randn_like(p) for p in params]
    grads[1][0] = float("inf")
    before = [g.clone() for g in grads]
    with pytest.raises(FloatingPointError):
        mem.project_(grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    other = GradientMemory(params, max_directions=3)
    other.load_state_dict(mem.state_dict())
    assert other.k == 1 and all(torch.equal(a, b) for a, b in zip(other.basis, mem.basis))


def test_gram_form_equals_orthonormal_form(device):
    params = make_params(device)
    dirs = [[torch.randn_like(p) for p in params] for _ in range(4)]
    gram, ortho = GramMemory(params, 4), GradientMemory(params, 4)
    gram.add(dirs)
    ortho.add(dirs)
    g1 = [torch.randn_like(p) for p in params]
    g2 = [t.clone() for t in g1]
    gram.project_(g1)
    ortho.project_(g2)
    torch.testing.assert_close(flat(g1), flat(g2), atol=1e-4, rtol=1e-4)


def test_gram_rank_deficient_warns_or_raises():
    params = make_params()
    d = [torch.randn_like(p) for p in params]
    with pytest.warns(UserWarning, match="rank-deficient"):
        GramMemory(params, 3).add([d, [2 * t for t in d]])
    with pytest.raises(ValueError, match="rank-deficient"):
        GramMemory(params, 3, strict=True).add([d, [2 * t for t in d]])


# ---- NullSpaceProjector ----

def projected_change(where, optimizer_cls=torch.optim.AdamW, **opt_kwargs):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    mem = GradientMemory(params, max_directions=6)
    mem.add([[torch.randn_like(p) for p in params] for _ in range(6)])
    opt = optimizer_cls(params, **opt_kwargs)
    NullSpaceProjector(opt, mem, where=where)
    before = [p.detach().clone() for p in params]
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(32, 8)).pow(2).mean().backward()
        opt.step()
    delta = [p.detach() - b for p, b in zip(params, before)]
    return mem.orthogonality_error(delta), flat(delta).norm().item()


def test_update_projection_holds_with_adamw_and_weight_decay():
    err, norm = projected_change("update", lr=1e-2, weight_decay=0.1)
    assert norm > 1e-3 and err <= 1e-5


def test_grad_projection_alone_does_not_hold_with_adamw():
    err, _ = projected_change("grad", lr=1e-2, weight_decay=0.1)
    assert err > 1e-2
    sgd_err, _ = projected_change("grad", optimizer_cls=torch.optim.SGD, lr=1e-2)
    assert sgd_err <= 1e-5  # with plain SGD projecting the gradient is enough


def test_projector_errors():
    params = make_params()
    mem = GradientMemory(params, 2)
    with pytest.raises(ValueError, match="where"):
        NullSpaceProjector(torch.optim.SGD(params, lr=0.1), mem, where="both")
    with pytest.raises(ValueError, match="not optimised"):
        NullSpaceProjector(torch.optim.SGD(params[:1], lr=0.1), mem)
    mem.add([torch.randn_like(p) for p in params])
    opt = torch.optim.SGD(params, lr=0.1)
    NullSpaceProjector(opt, mem, where="grad")
    with pytest.raises(ValueError, match="no gradient"):
        opt.step()
