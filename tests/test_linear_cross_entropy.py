"""linear_cross_entropy against reference.py (float64 F.cross_entropy of hidden @ weight.T)."""
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda_only
from torch.utils._python_dispatch import TorchDispatchMode

from adept_ext import reference
from adept_ext.ops import cross_entropy, linear_cross_entropy, linear_cross_entropy_backward, linear_cross_entropy_sum

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(n, h, v, device, dtype=torch.float32, ignore_every=0):
    hidden = (torch.randn(n, h, device=device) * 2).to(dtype)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), device=device)
    if ignore_every:
        targets[::ignore_every] = -100
    return hidden, weight, targets


def plain_torch(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.T, targets, reduction="none").double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 5, None), (37, 64, 1000, 7), (130, 33, 517, None), (64, 16, 3, 64)])
def test_matches_reference(device, dtype, n, h, v, chunk):
    hidden, weight, targets = make(n, h, v, device, dtype, ignore_every=5 if n > 1 else 0)  # n = 1: a row to judge
    got = linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk)
    assert got.dtype == torch.float32 and got.shape == (n,)
    exact = reference.linear_cross_entropy(hidden, weight, targets)
    assert (got[targets == -100] == 0).all()
    err = (got.double() - exact).abs()
    err_torch = (plain_torch(hidden, weight, targets) - exact).abs()
    if dtype == torch.float32:
        assert err.max() <= 1e-5 * exact.abs().max() + 1e-6
    else:  # judged against plain PyTorch in the same precision, by the largest error
        assert err.max() <= 2 * err_torch.max() + 1e-3, (err.max(), err_torch.max())


def test_chunking_does_not_change_the_result(device):
    hidden, weight, targets = make(100, 32, 300, device)
    full = linear_cross_entropy(hidden, weight, targets, chunk_rows=1000)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk), full)


def test_custom_ignore_index_and_all_ignored(device):
    hidden, weight, targets = make(10, 8, 20, device)
    targets[3] = 7
    targets[4] = 7
    got = linear_cross_entropy(hidden, weight, targets, ignore_index=7)
    assert got[3] == 0 and got[4] == 0 and (got[targets != 7] > 0).all()
    assert (linear_cross_entropy(hidden, weight, torch.full_like(targets, -100)) == 0).all()


def test_empty_rows(device):
    hidden, weight, _ = make(0, 8, 20, device)
    assert linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long, device=device)).shape == (0,)


def test_large_logits_are_stable(device):
    hidden, weight, targets = make(16, 8, 50, device)
    hidden = hidden * 1000
    got = linear_cross_entropy(hidden, weight, targets)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference.linear_cross_entropy(hidden, weight, targets),
                               rtol=1e-5, atol=1e-2)


def lowprec_ok(got, hidden, weight, targets, rows=slice(None)):
    """Max error vs the float64 reference: float32 within 1e-5 relative; bfloat16/float16 within
    twice plain PyTorch's max error in the same precision (flash-attention style)."""
    exact = reference.linear_cross_entropy(hidden, weight, targets).cpu()[rows]
    err = (got.double().cpu()[rows] - exact).abs().max()
    if hidden.dtype == torch.float32:
        return err <= 1e-5 * (1 + exact.abs().max()), (err, exact.abs().max())
    err_torch = (plain_torch(hidden, weight, targets).cpu()[rows] - exact).abs().max()
    return err <= 2 * err_torch + 1e-4, (err, err_torch)


# Vocabularies of 45 (not a multiple of 8: the CUDA kernel reads logits one by one, and logit 43
# lies in the CPU kernel's vector tail), 48 (16-byte rows: the CUDA kernel reads 16-byte packs and
# logit 43 shares its pack with finite logits) and 4096 (each of the CUDA kernel's 256 threads reads
# two packs: the thread that met the +inf or NaN at 41-43 then reads a pack of finite logits).
VOCABS_BOTH_PATHS = [45, 48, 4096]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", VOCABS_BOTH_PATHS)
def test_infinite_logits(device, dtype, v):
    # Logits that overflow the GEMM's dtype are ±inf. A -inf logit adds exp(-inf) = 0 to the sum;
    # a +inf one makes the loss +inf (not NaN, as the CUDA kernel once gave); a -inf target logit
    # makes it +inf too; a +inf target logit is inf - inf = NaN. CPU and CUDA give the same.
    big = 256.0 if dtype == torch.float16 else 2.0**65  # big² overflows the dtype, big does not
    h, neg, pos = 8, 5, 43
    a = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])  # hidden feature 0 (× big): logit `neg` is -inf where 1
    b = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])  # hidden feature 1 (× big): logit `pos` is +inf where 1
    hidden = torch.cat([(a * big)[:, None], (b * big)[:, None], torch.randn(5, h - 2)], 1)
    weight = torch.cat([torch.zeros(v, 2), torch.randn(v, h - 2) / h**0.5], 1)
    weight[neg] = 0
    weight[neg, 0] = -big
    weight[pos] = 0
    weight[pos, 1] = big
    targets = torch.tensor([3, 3, neg, 3, pos])
    hidden, weight, targets = hidden.to(device, dtype), weight.to(device, dtype), targets.to(device)
    logits = (hidden @ weight.T).cpu()
    assert logits[0, neg] == -float("inf") and logits[1, pos] == float("inf") and torch.isfinite(logits[0, pos])
    got = linear_cross_entropy(hidden, weight, targets).cpu()
    ok, info = lowprec_ok(got, hidden, weight, targets, rows=slice(0, 1))  # -inf only: the reference holds
    assert ok, info
    assert got[1:4].tolist() == [float("inf")] * 3 and torch.isnan(got[4]), got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", VOCABS_BOTH_PATHS)
def test_nan_logit_gives_nan(device, dtype, v):
    # One NaN weight row makes that logit NaN in every row: every loss is NaN (as plain PyTorch),
    # never a finite number that skipped it; ignored rows stay 0.
    hidden, weight, targets = make(6, 8, v, device, dtype)
    weight[41] = float("nan")
    targets[2] = -100
    got = linear_cross_entropy(hidden, weight, targets).cpu()
    assert torch.isnan(got[[0, 1, 3, 4, 5]]).all() and got[2] == 0, got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [32768 + 17, 32768])  # one by one, and 16-byte packs on CUDA
def test_realistic_vocabulary_max_error(device, dtype, v):
    hidden, weight, targets = make(16, 64, v, device, dtype, ignore_every=7)
    got = linear_cross_entropy(hidden, weight, targets, chunk_rows=5)
    ok, info = lowprec_ok(got, hidden, weight, targets)
    assert ok, info


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [1, 3])
def test_unaligned_views(device, dtype, shift):
    n, h, v = 21, 33, 301
    hidden = torch.randn(n * h + shift, device=device).to(dtype)[shift:].view(n, h)
    weight = (torch.randn(v * h + shift, device=device) / h**0.5).to(dtype)[shift:].view(v, h)
    targets = torch.randint(0, v, (n + shift,), device=device)[shift:]
    got = linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    ok, info = lowprec_ok(got, hidden, weight, targets)
    assert ok, info


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_cuda_agree(dtype):
    # The same logsumexp in float32 on each side; the GEMMs (MKL/oneDNN vs cuBLAS) round
    # differently: |cpu - cuda| <= 1e-4·(1 + |loss|) in float32, 2^-6·(1 + |loss|) in bfloat16
    # (a few bfloat16 ulps of the logits).
    hidden, weight, targets = make(64, 128, 5000, "cpu", dtype, ignore_every=9)
    cpu = linear_cross_entropy(hidden, weight, targets)
    cuda = linear_cross_entropy(hidden.cuda(), weight.cuda(), targets.cuda()).cpu()
    rel = 1e-4 if dtype == torch.float32 else 2.0**-6
    assert ((cpu - cuda).abs() <= rel * (1 + cpu.abs())).all(), (cpu - cuda).abs().max()


def test_opcheck(device):
    hidden, weight, targets = make(9, 8, 20, device, ignore_every=4)
    torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy.default, (hidden, weight, targets, -100, 4))


def test_torch_compile_fullgraph(device):
    hidden, weight, targets = make(12, 8, 20, device)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def mean_loss(h, w, t):
        return linear_cross_entropy(h, w, t, chunk_rows=5).mean()

    torch.testing.assert_close(mean_loss(hidden, weight, targets).double(),
                               reference.linear_cross_entropy(hidden, weight, targets).mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args,exc,match", [
    (lambda h, w, t: (h[0], w, t), ValueError, "expected hidden"),
    (lambda h, w, t: (h, w[:, :3], t), ValueError, "features"),
    (lambda h, w, t: (h, w, t[:2]), ValueError, "targets"),
    (lambda h, w, t: (h, w.double(), t), TypeError, "dtype"),
    (lambda h, w, t: (h.double(), w.double(), t), TypeError, "dtype"),
    (lambda h, w, t: (h, w, t.int()), TypeError, "int64"),
    (lambda h, w, t: (h, w.to("meta"), t), ValueError, "one device"),
    (lambda h, w, t: (h, w, t.clone().fill_(20)), ValueError, r"targets\[0\] = 20 is outside \[0, 20\)"),
    (lambda h, w, t: (h, w, t.clone().fill_(-3)), ValueError, "outside"),
])
def test_errors(args, exc, match):
    hidden, weight, targets = make(4, 8, 20, "cpu")
    with pytest.raises(exc, match=match):
        linear_cross_entropy(*args(hidden, weight, targets))


def test_error_chunk_rows_and_reduction():
    hidden, weight, targets = make(4, 8, 20, "cpu")
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, weight, targets, chunk_rows=0)
    with pytest.raises(ValueError, match=r"reduction must be one of \('none', 'sum', 'mean'\), got 'avg'"):
        linear_cross_entropy(hidden, weight, targets, reduction="avg")


# reduction="none" | "sum" | "mean", against F.linear + F.cross_entropy with the same reduction.

def f_cross_entropy(hidden, weight, targets, reduction, dtype=None):
    """(loss, ∂hidden, ∂weight) of F.cross_entropy(F.linear(h, w), reduction=...): in float64 (dtype
    torch.float64, the reference) or in the inputs' dtype with float32 logits (what a user writes)."""
    h, w = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (hidden, weight))
    loss = F.cross_entropy(F.linear(h, w).float() if dtype is None else F.linear(h, w), targets, reduction=reduction)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w), torch.ones_like(loss)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("n,h,v,chunk", [(37, 24, 301, 8), (1, 8, 5, None)])
def test_reductions_match_f_cross_entropy(device, dtype, reduction, n, h, v, chunk, monkeypatch):
    hidden, weight, targets = make(n, h, v, device, dtype, ignore_every=5 if n > 1 else 0)
    fused, real = [], cross_entropy.linear_cross_entropy_sum_op  # "sum" and "mean" take the one-pass op
    monkeypatch.setattr(cross_entropy, "linear_cross_entropy_sum_op", lambda *args: fused.append(1) or real(*args))
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(hs, ws, targets, chunk_rows=chunk, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ((n,) if reduction == "none" else ())
    assert len(fused) == (reduction != "none")
    ours = (loss.detach(), *torch.autograd.grad(loss, (hs, ws), torch.ones_like(loss)))
    exact = f_cross_entropy(hidden, weight, targets, reduction, torch.float64)
    plain = f_cross_entropy(hidden, weight, targets, reduction)
    for got, torch_got, ref in zip(ours, plain, exact):
        assert got.shape == ref.shape
        err = (got.double() - ref).abs().max()
        if dtype == torch.float32:
            assert err <= 2e-5 * ref.abs().max() + 1e-6, err
        else:  # judged against plain PyTorch in the same precision, by the largest error
            assert err <= 2 * (torch_got.double() - ref).abs().max() + 1e-5, (err, torch_got, ref)


@pytest.mark.parametrize("n", [0, 6])
def test_mean_over_no_valid_row_is_nan_with_zero_gradients(n):
    # as F.cross_entropy(reduction="mean"): 0 / 0 = NaN, and the gradients 0 (not 0 · inf = NaN)
    hidden, weight, targets = make(n, 8, 20, "cpu")
    targets.fill_(-100)
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(hs, ws, targets, reduction="mean")
    loss.backward()
    torch_loss, torch_gh, torch_gw = f_cross_entropy(hidden, weight, targets, "mean")
    assert torch.isnan(loss) and torch.isnan(torch_loss)
    assert torch.equal(hs.grad, torch_gh) and torch.equal(ws.grad, torch_gw) and not ws.grad.any()
    assert linear_cross_entropy(hidden, weight, targets, reduction="sum") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mean_scales_the_hidden_gradient_in_float32(dtype):
    # 1/235 rounded to bfloat16 is 0.31 % too small (float16: 0.044 % too large); scaled by it, every
    # element of the hidden gradient was biased the same way. The least-squares factor between ours and
    # the float64 gradient stays within a third of that bias of 1 (the elements' own rounding is unbiased).
    n = 235
    hidden, weight, targets = make(n, 64, 128, "cpu", dtype)
    h = hidden.clone().requires_grad_()
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, weight, targets, reduction="mean"), h)
    ref = f_cross_entropy(hidden, weight, targets, "mean", torch.float64)[1]
    factor = float((gh.double() * ref).sum() / (ref * ref).sum())
    rounding_bias = abs(float(torch.tensor(1 / n).to(dtype).double()) * n - 1)
    assert abs(factor - 1) < rounding_bias / 3, (factor, rounding_bias)


# Autograd: the backward recomputes the logits chunk by chunk; judged against float64 autograd
# through reference.linear_cross_entropy.

def reference_grads(hidden, weight, targets, grad_loss, ignore_index=-100):
    """float64 (∂/∂hidden, ∂/∂weight) of Σ_i grad_loss_i · loss_i, by autograd through the reference."""
    h, w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = reference.linear_cross_entropy(h, w, targets, ignore_index)
    return torch.autograd.grad(loss, (h, w), grad_loss.double())


def ours_and_plain_torch_grads(hidden, weight, targets, grad_loss, ignore_index=-100, chunk=None):
    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    ours = torch.autograd.grad(linear_cross_entropy(h, w, targets, ignore_index, chunk), (h, w), grad_loss)
    plain = torch.autograd.grad(F.cross_entropy(h @ w.T, targets, ignore_index=ignore_index, reduction="none"),
                                (h, w), grad_loss.to(h.dtype))
    return ours, plain


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 5, None), (37, 64, 1000, 7), (130, 33, 517, None), (64, 16, 3, 64),
                                         (50, 24, 301, 1)])
def test_gradients_match_reference(device, dtype, n, h, v, chunk):
    hidden, weight, targets = make(n, h, v, device, dtype, ignore_every=5 if n > 1 else 0)  # n = 1: a row to judge
    grad_loss = torch.randn(n, device=device)
    ours, plain = ours_and_plain_torch_grads(hidden, weight, targets, grad_loss, chunk=chunk)
    exact = reference_grads(hidden, weight, targets, grad_loss)
    for got, torch_got, ref, like in zip(ours, plain, exact, (hidden, weight)):
        assert got.dtype == dtype and got.shape == like.shape
        err = (got.double() - ref).abs()
        if dtype == torch.float32:
            assert err.max() <= 2e-5 * ref.abs().max() + 1e-7, (err.max(), ref.abs().max())
        else:  # judged against plain PyTorch autograd in the same precision, by the largest error
            err_torch = (torch_got.double() - ref).abs()
            assert err.max() <= 2 * err_torch.max() + 1e-5, (err.max(), err_torch.max())
    assert (ours[0][targets == -100] == 0).all()  # an ignored row gets no gradient


@pytest.mark.parametrize("ignore_index", [7, 10**6])
def test_gradients_with_custom_ignore_index(device, ignore_index):
    # 7 is a class (rows with target 7 are ignored; other rows' softmax still covers class 7);
    # 10**6 lies outside [0, V)
    hidden, weight, targets = make(30, 16, 20, device)
    targets[::3] = ignore_index
    grad_loss = torch.randn(30, device=device)
    (gh, gw), _ = ours_and_plain_torch_grads(hidden, weight, targets, grad_loss, ignore_index, chunk=4)
    rh, rw = reference_grads(hidden, weight, targets, grad_loss, ignore_index)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-5, atol=1e-6)


def test_backward_into_leaves_and_only_what_is_needed(device):
    # .backward() through a mean over the valid rows, as a training loop uses it; a frozen weight
    # gets no gradient and hidden's still matches
    hidden, weight, targets = make(20, 8, 30, device, ignore_every=3)
    valid = (targets != -100).sum()
    for frozen in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
        (linear_cross_entropy(h, w, targets, chunk_rows=6).sum() / valid).backward()
        rh, rw = reference_grads(hidden, weight, targets, torch.full((20,), 1 / valid, device=device))
        torch.testing.assert_close(h.grad.double(), rh, rtol=1e-5, atol=1e-7)
        if frozen:
            assert w.grad is None
        else:
            torch.testing.assert_close(w.grad.double(), rw, rtol=1e-5, atol=1e-7)


def test_backward_of_empty_rows_and_all_ignored(device):
    for n, fill in ((0, None), (6, -100)):
        hidden, weight, targets = make(n, 8, 20, device)
        if fill is not None:
            targets.fill_(fill)
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        gh, gw = torch.autograd.grad(linear_cross_entropy(h, w, targets).sum(), (h, w))
        assert gh.shape == (n, 8) and gw.shape == (20, 8) and not gh.any() and not gw.any()


def test_finite_difference_gradcheck():
    # The op has no float64 kernel: float32 central differences on a tiny, well-scaled problem
    # (truncation ~eps², rounding ~1e-7/eps), one ignored row, three chunks
    hidden, weight, targets = make(5, 4, 6, "cpu")
    targets[2] = -100
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, targets, chunk_rows=2), (h, w),
                                        eps=1e-2, atol=1e-3, rtol=1e-2)


def test_backward_with_inf_logits_stays_finite_at_ignored_rows(device):
    # an ignored row whose logits overflow contributes exactly 0, not NaN, to both gradients
    hidden, weight, targets = make(4, 8, 10, device)
    hidden[1] = 3e38
    targets[1] = -100
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    gh, gw = torch.autograd.grad(linear_cross_entropy(h, w, targets).sum(), (h, w))
    assert torch.isfinite(gw).all() and not gh[1].any()


@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)])
def test_opcheck_requires_grad(device, needs):
    hidden, weight, targets = make(9, 8, 20, device, ignore_every=4)
    hidden.requires_grad_(needs[0])
    weight.requires_grad_(needs[1])
    torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy.default, (hidden, weight, targets, -100, 4))


def forward_lse(hidden, weight, targets, ignore_index=-100, chunk=4):
    return torch.ops.adept_ext.linear_cross_entropy.default(hidden, weight, targets, ignore_index, chunk)[1]


def test_opcheck_backward_op(device):
    hidden, weight, targets = make(9, 8, 20, device, ignore_every=4)
    lse = forward_lse(hidden, weight, targets)
    for need in ((True, True), (False, True)):
        torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy_backward.default,
                              (torch.randn(9, device=device), hidden, weight, targets, lse, -100, 4, *need))


def test_opcheck_grad_logits_op(device):
    hidden, weight, targets = make(9, 8, 37, device, ignore_every=4)
    lse = forward_lse(hidden, weight, targets)
    torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy_grad_logits_.default,
                          (hidden @ weight.T, targets, lse, torch.randn(9, device=device), -100))


def test_torch_compile_fullgraph_backward(device):
    hidden, weight, targets = make(12, 8, 20, device, ignore_every=5)

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=True)
    def mean_loss(h, w, t):
        return linear_cross_entropy(h, w, t, chunk_rows=5).mean()

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mean_loss(h, w, targets).backward()
    rh, rw = reference_grads(hidden, weight, targets, torch.full((12,), 1 / 12, device=device))
    torch.testing.assert_close(h.grad.double(), rh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), rw, rtol=1e-5, atol=1e-7)


def test_double_backward_raises():
    hidden, weight, targets = make(5, 4, 6, "cpu")
    h = hidden.requires_grad_()
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, weight, targets).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy_backward.* no autograd formula"):
        gh.sum().backward()


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op creates while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_backward_never_holds_more_than_one_chunk_of_logits():
    # N × V = 32000 logits; one chunk is 8 × 500; the gradients are 64 × 4 and 500 × 4
    n, h, v, chunk = 64, 4, 500, 8
    hidden, weight, targets = make(n, h, v, "cpu", ignore_every=5)
    grad_loss = torch.randn(n)
    with LargestTensor() as mode:
        lse = forward_lse(hidden, weight, targets, chunk=chunk)
        got = linear_cross_entropy_backward(grad_loss, hidden, weight, targets, lse, -100, chunk, True, True)
    assert mode.numel == chunk * v
    for g, r in zip(got, reference_grads(hidden, weight, targets, grad_loss)):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


def _autocast_grads(inputs, dtype, backward_inside: bool):
    hidden, weight, targets = inputs
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast(hidden.device.type, dtype=dtype):
        loss = linear_cross_entropy(hidden, weight, targets).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_in_both_passes(device, dtype):
    """Under autocast the op runs on hidden and weight cast to the autocast dtype, as F.linear
    does: the forward and the backward (recomputed logits) in that dtype, so backward() inside
    and outside the autocast context (PyTorch's mixed-precision recipe) give the same
    gradients, equal to the op on inputs cast by hand; the gradients reach the fp32 leaves."""
    hidden, weight, targets = make(40, 16, 300, device, ignore_every=7)
    inside = _autocast_grads((hidden, weight, targets), dtype, True)
    outside = _autocast_grads((hidden, weight, targets), dtype, False)
    for a, b in zip(inside, outside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    by_hand_h, by_hand_w = hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
    by_hand = linear_cross_entropy(by_hand_h, by_hand_w, targets).sum()
    by_hand.backward()
    assert inside[1].dtype == inside[2].dtype == torch.float32
    torch.testing.assert_close(inside[0], by_hand.detach(), rtol=0, atol=0)
    torch.testing.assert_close(inside[1], by_hand_h.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(inside[2], by_hand_w.grad.float(), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_backward_uses_the_forwards_dtypes_across_autocast(device, reduction):
    """A backward outside autocast after a forward inside it, or inside after a forward outside
    (Liger's PR #1283): the gradients are those of the forward's dtypes, as without autocast."""
    hidden, weight, targets = make(20, 16, 50, device, ignore_every=7)
    device_type = torch.device(device).type

    def grads(forward_autocast: bool, backward_autocast: bool, cast=lambda t: t):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=forward_autocast):
            loss = linear_cross_entropy(cast(h), cast(w), targets, chunk_rows=6, reduction=reduction).sum()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=backward_autocast):
            loss.backward()
        return h.grad, w.grad

    # forward inside, backward outside: the gradients of the bf16 forward, as on inputs cast by hand
    torch.testing.assert_close(grads(True, False), grads(False, False, lambda t: t.bfloat16()), rtol=0, atol=0)
    # forward outside, backward inside: the gradients of the float32 forward
    torch.testing.assert_close(grads(False, True), grads(False, False), rtol=0, atol=0)


def test_autocast_accepts_mixed_dtypes_and_follows_the_autocast_dtype(device):
    """Under autocast a bf16 hidden with an fp32 weight (an autocast linear's output and a master
    weight) is accepted and both run in the autocast dtype; outside autocast the pair is refused."""
    hidden, weight, targets = make(9, 8, 20, device)
    with pytest.raises(TypeError, match="share a dtype"):
        linear_cross_entropy(hidden.bfloat16(), weight, targets)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        mixed = linear_cross_entropy(hidden.bfloat16(), weight, targets)
    torch.testing.assert_close(mixed, linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets),
                               rtol=0, atol=0)


# The backward's one-pass kernel and its second input, the forward's per-row logsumexp.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(0, 7), (1, 5), (13, 31), (9, 1000), (4, 16)])
def test_forward_logsumexp_matches_reference(device, dtype, n, v):
    hidden, weight, targets = make(n, 16, v, device, dtype, ignore_every=3)
    loss, lse = torch.ops.adept_ext.linear_cross_entropy.default(hidden, weight, targets, -100, 5)
    exact = reference.linear_cross_entropy_logsumexp(hidden, weight, targets)
    assert lse.dtype == torch.float32 and lse.shape == (n,) and (lse[targets == -100] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse.double(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(0, 7), (1, 5), (13, 31), (9, 1000), (6, 16), (5, 3)])
def test_grad_logits_matches_reference(device, dtype, n, v):
    # odd vocabularies (a tail after the vector loop; the CUDA kernel's unvectorised rows), ignored
    # rows, targets at both ends of the row, a grad_loss that differs per row
    hidden, weight, targets = make(n, 16, v, device, dtype, ignore_every=3)
    if n > 2:
        targets[1], targets[2] = 0, v - 1
    grad_loss = torch.randn(n, device=device)
    lse = forward_lse(hidden, weight, targets)
    logits = hidden @ weight.T
    exact = reference.linear_cross_entropy_grad_logits(logits, targets, lse, grad_loss)
    torch.ops.adept_ext.linear_cross_entropy_grad_logits_.default(logits, targets, lse, grad_loss, -100)
    assert logits.dtype == dtype and (logits[targets == -100] == 0).all()
    err = (logits.double() - exact).abs().max() if n else 0
    rounding = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert err <= rounding * max(1.0, float(exact.abs().max()) if n else 0), err


def test_grad_logits_refuses_a_target_outside_the_vocabulary():
    hidden, weight, targets = make(3, 8, 20, "cpu")
    lse = forward_lse(hidden, weight, targets)
    targets[1] = 20
    with pytest.raises(ValueError, match="target 20 out of range"):
        torch.ops.adept_ext.linear_cross_entropy_grad_logits_.default(hidden @ weight.T, targets, lse,
                                                                      torch.ones(3), -100)


def test_weight_grad_paths():
    # CPU: float32 accumulates with addmm_; bfloat16/float16 through float32 copies of the chunk
    # (torch has no CPU kernel for addmm's out_dtype); on CUDA the out_dtype GEMM where this torch has it.
    assert cross_entropy.weight_grad_path("cpu", torch.float32) == "float32"
    assert cross_entropy.weight_grad_path("cpu", torch.bfloat16) == "float32_copies"
    assert set(cross_entropy.WEIGHT_GRAD_PATHS) == {"float32", "out_dtype", "float32_copies", "temporary"}


def test_out_dtype_probe_requires_accumulation(monkeypatch):
    # the backward adds each chunk's dᵀh into out=: a kernel that overwrites out (beta = 0) must fail the probe
    probe = cross_entropy._addmm_out_dtype_runs.__wrapped__  # uncached
    monkeypatch.setattr(torch, "addmm", lambda c, a, b, out_dtype, out: torch.mm(a.float(), b.float(), out=out))
    assert not probe("cpu", torch.bfloat16)
    monkeypatch.setattr(torch, "addmm", lambda c, a, b, out_dtype, out: out.copy_(c + a.float() @ b.float()))
    assert probe("cpu", torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_path_forced_agrees_with_the_probe(dtype):
    # forced on every CUDA device: where addmm(out_dtype=float32) runs, it accumulates into a non-zero
    # out= and the probe chose it; where it does not run, the probe did not choose it
    d, h = torch.randn(64, 300, device="cuda", dtype=dtype), torch.randn(64, 24, device="cuda", dtype=dtype)
    start = torch.randn(300, 24, device="cuda")
    out = start.clone()
    try:
        torch.addmm(out, d.T, h, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        assert cross_entropy.weight_grad_path("cuda", dtype) != "out_dtype"
        return
    torch.testing.assert_close(out, start + d.T.float() @ h.float(), rtol=1e-4, atol=1e-4)
    assert cross_entropy.weight_grad_path("cuda", dtype) == "out_dtype"


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [32001, 50257, 151665, 4096])
def test_cuda_row_kernels_on_rows_of_every_alignment(dtype, v):
    # V·sizeof(T) not a multiple of 16 (and a base 3 elements past an allocation): the rows start at
    # every alignment, each read in 16-byte packs from its own first boundary with a head and a tail
    # one by one; 4096: aligned rows. At these V each thread's pack loop runs several times (bf16:
    # 8 per pack, 2048 per sweep of 256 threads). Targets at both ends of a row and an ignored row.
    n = 6
    hidden, weight, targets = make(n, 16, v, "cuda", dtype)
    targets[:3] = torch.tensor([0, v - 1, -100])
    logits = torch.empty(n * v + 3, device="cuda", dtype=dtype)[3:].view(n, v)
    torch.mm(hidden, weight.T, out=logits)
    exact = logits.double()
    loss, lse = torch.ops.adept_ext.linear_cross_entropy_rows.default(logits, targets, -100)
    want = F.cross_entropy(exact, targets, reduction="none")
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    grad_loss = torch.randn(n, device="cuda")
    want_grad = reference.linear_cross_entropy_grad_logits(exact, targets, lse, grad_loss)
    torch.ops.adept_ext.linear_cross_entropy_grad_logits_.default(logits, targets, lse, grad_loss, -100)
    rounding = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert (logits.double() - want_grad).abs().max() <= rounding * max(1.0, float(want_grad.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_weight_grad_path_gives_the_gradient(device, dtype, monkeypatch):
    # each fallback the backward may take on a device is run here and judged against the reference
    hidden, weight, targets = make(37, 24, 301, device, dtype, ignore_every=5)
    grad_loss = torch.randn(37, device=device)
    exact = reference_grads(hidden, weight, targets, grad_loss)[1]
    paths = ["float32_copies", "temporary"] + (["out_dtype"] if cross_entropy.weight_grad_path(
        torch.device(device).type, dtype) == "out_dtype" else [])
    for path in paths:
        monkeypatch.setattr(cross_entropy, "weight_grad_path", lambda *args: path)
        w = weight.clone().requires_grad_()
        (gw,) = torch.autograd.grad(linear_cross_entropy(hidden, w, targets, chunk_rows=8), w, grad_loss)
        plain = torch.autograd.grad(F.cross_entropy(hidden @ w.T, targets, reduction="none"), w, grad_loss.to(dtype))
        err, err_torch = (gw.double() - exact).abs().max(), (plain[0].double() - exact).abs().max()
        assert err <= 2 * err_torch + 1e-5, (path, err, err_torch)


# linear_cross_entropy_sum: the same losses summed, the gradients computed in the forward.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 5, None), (37, 64, 1000, 7), (50, 24, 301, 1), (0, 8, 20, None)])
def test_sum_equals_the_rows_and_its_gradients_the_reference(device, dtype, n, h, v, chunk):
    hidden, weight, targets = make(n, h, v, device, dtype, ignore_every=5)
    count = max(int((targets != -100).sum()), 1)
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = linear_cross_entropy_sum(hs, ws, targets, chunk_rows=chunk)
    assert total.dtype == torch.float32 and total.shape == ()
    assert torch.equal(total.detach(), linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk).sum())
    (total / count).backward()
    grad_loss = torch.full((n,), 1 / count, device=device)
    exact = reference_grads(hidden, weight, targets, grad_loss)
    _, plain = ours_and_plain_torch_grads(hidden, weight, targets, grad_loss)
    for got, torch_got, ref in zip((hs.grad, ws.grad), plain, exact):
        assert got.dtype == dtype and got.shape == ref.shape
        if not got.numel():
            continue
        err = (got.double() - ref).abs().max()
        if dtype == torch.float32:
            assert err <= 2e-5 * ref.abs().max() + 1e-7, err
        else:
            assert err <= 2 * (torch_got.double() - ref).abs().max() + 1e-5, err


def test_sum_computes_only_the_gradients_needed(monkeypatch):
    hidden, weight, targets = make(64, 4, 500, "cpu", ignore_every=5)
    flags, real = [], cross_entropy.linear_cross_entropy_sum_op
    monkeypatch.setattr(cross_entropy, "linear_cross_entropy_sum_op",
                        lambda *args: flags.append(args[-2:]) or real(*args))
    for requires in ((False, False), (True, False), (False, True), (True, True)):
        h, w = hidden.clone().requires_grad_(requires[0]), weight.clone().requires_grad_(requires[1])
        total = linear_cross_entropy_sum(h, w, targets, chunk_rows=8)
        if any(requires):
            total.backward()
        assert (h.grad is not None) == requires[0] and (w.grad is not None) == requires[1]
        with torch.no_grad():
            assert torch.equal(linear_cross_entropy_sum(h, w, targets), linear_cross_entropy(h, w, targets).sum())
    assert flags == [(False, False), (False, False), (True, False), (False, False), (False, True), (False, False),
                     (True, True), (False, False)]
    for need in ((False, False), (True, True)):  # one chunk of logits at a time ([V, H] is 2000 here)
        with LargestTensor() as mode:
            cross_entropy.linear_cross_entropy_sum_forward(hidden, weight, targets, -100, 8, *need)
        assert mode.numel == 8 * 500
    with LiveBytes() as live:  # and never two at once: the previous chunk is freed before the next GEMM
        cross_entropy.linear_cross_entropy_sum_forward(hidden, weight, targets, -100, 8, True, True)
    chunk, grads = 8 * 500 * 4, (500 * 4 + 64 * 4) * 4
    assert chunk + grads <= live.peak < 1.5 * chunk + grads, live.peak


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors created by ops (not views) held at once while the mode was on."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, set()

    def _freed(self, storage, nbytes):
        self.storages.discard(storage)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            storage = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()
            if storage and storage not in self.storages and storage not in inputs:  # not a view, not an out=
                nbytes = t.untyped_storage().nbytes()
                self.storages.add(storage)
                self.live += nbytes
                weakref.finalize(t, self._freed, storage, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def test_sum_opcheck_compile_and_autocast(device):
    hidden, weight, targets = make(12, 8, 20, device, ignore_every=5)
    for need in ((True, True), (False, True), (False, False)):
        torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy_sum.default,
                              (hidden, weight, targets, -100, 5, *need))
    torch.library.opcheck(torch.ops.adept_ext.linear_cross_entropy_rows.default, (hidden @ weight.T, targets, -100))

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=True)
    def mean_loss(h, w, t):
        return linear_cross_entropy(h, w, t, chunk_rows=5, reduction="mean")

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mean_loss(h, w, targets).backward()
    rh, rw = reference_grads(hidden, weight, targets, torch.full((12,), 1 / 9, device=device))  # 9 valid rows
    torch.testing.assert_close(h.grad.double(), rh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), rw, rtol=1e-5, atol=1e-7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        total = linear_cross_entropy_sum(h, w, targets)
    total.backward()
    bh, bw = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    by_hand = linear_cross_entropy_sum(bh, bw, targets)
    by_hand.backward()
    assert torch.equal(total, by_hand) and h.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, bh.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, bw.grad.float(), rtol=0, atol=0)


def test_sum_refuses_a_double_backward():
    hidden, weight, targets = make(5, 4, 6, "cpu")
    h = hidden.requires_grad_()
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(linear_cross_entropy_sum(h, weight, targets), h, create_graph=True)


def test_sum_backward_twice_through_one_graph_raises():
    # the stored gradients are scaled in place (no second [V, H] at the peak): a retained graph's
    # second backward must fail loudly, not double the scale
    hidden, weight, targets = make(6, 4, 9, "cpu")
    w = weight.clone().requires_grad_()
    total = linear_cross_entropy_sum(hidden, w, targets) / 3
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        total.backward()
