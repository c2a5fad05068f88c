"""taylor_importance against reference.py: dtypes, odd and empty shapes, many tensors,
accumulation, determinism, opcheck, torch.compile and every error path."""
import pytest
import torch
from conftest import cuda_only, integer_valued

import adept_ext
from adept_ext import reference
from adept_ext.ops import taylor_importance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps


def make_pairs(sizes, device, pdtype=torch.float32, gdtype=None):
    gdtype = gdtype or pdtype
    params = [torch.randn(s, device=device).to(pdtype) for s in sizes]
    grads = [torch.randn(s, device=device).to(gdtype) for s in sizes]
    return params, grads


def plain_torch(params, grads):
    """The sums as a user would compute them, in the inputs' own precision."""
    rows = []
    for p, g in zip(params, grads):
        x = p * g.to(p.dtype)
        rows.append(torch.stack([x.sum(), x.abs().sum()]).double())
    return torch.stack(rows)


def assert_close_to_reference(params, grads, got):
    """|ours − exact| ≤ 2·|plain torch in the same precision − exact| + 8·eps32·Σ|θg| (flash-attention style)."""
    exact = reference.taylor_importance(params, grads).cpu()
    got = got.double().cpu()
    err_ours = (got - exact).abs()
    err_torch = (plain_torch(params, grads).cpu() - exact).abs()
    bound = 2 * err_torch + 8 * EPS32 * exact[:, 1:2] + 1e-30
    bad = (err_ours > bound).nonzero()
    assert bad.numel() == 0, f"rows {bad[:, 0].tolist()[:5]}: got {got[bad[0, 0]]}, exact {exact[bad[0, 0]]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [0, 1, 3, 17, 65537, (33, 129), (3, 5, 7)])
def test_matches_reference_one_tensor(device, dtype, size):
    params, grads = make_pairs([size], device, dtype)
    got = taylor_importance(params, grads)
    assert got.dtype == torch.float32 and got.shape == (1, 2) and got.device.type == device
    assert_close_to_reference(params, grads, got)


@pytest.mark.parametrize("pdtype,gdtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_mixed_param_and_grad_dtypes(device, pdtype, gdtype):
    params, grads = make_pairs([1000, 70001, 5], device, pdtype, gdtype)
    assert_close_to_reference(params, grads, taylor_importance(params, grads))


def test_many_tensors_mixed_dtypes_and_empty(device):
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 300, (2000,), generator=gen).tolist()
    sizes[::97] = [0] * len(sizes[::97])
    params, grads = [], []
    for k, s in enumerate(sizes):
        pd, gd = DTYPES[k % 3], DTYPES[(k // 3) % 3]
        params.append(torch.randn(s, device=device).to(pd))
        grads.append(torch.randn(s, device=device).to(gd))
    got = taylor_importance(params, grads)
    assert got.shape == (2000, 2)
    assert (got[torch.tensor(sizes) == 0] == 0).all()
    assert_close_to_reference(params, grads, got)


def test_one_tensor_spanning_many_chunks_with_odd_tail(device):
    params, grads = make_pairs([32768 * 37 + 5, 3, 32768], device)
    assert_close_to_reference(params, grads, taylor_importance(params, grads))


def test_chunk_boundaries_are_all_counted(device):
    # Exact small integers: every element contributes a known amount, so a skipped or
    # double-counted element anywhere (chunk edges, vector tails) changes the result.
    n = 32768 * 3 + 19
    p = torch.ones(n, device=device)
    g = torch.arange(n, device=device, dtype=torch.float32) % 7 - 3
    got = taylor_importance([p], [g])
    expect_dot = float((torch.arange(n) % 7 - 3).sum())
    expect_abs = float((torch.arange(n) % 7 - 3).abs().sum())
    assert got.tolist() == [[expect_dot, expect_abs]]


def test_non_contiguous_inputs_are_handled(device):
    base_p, base_g = make_pairs([(300, 200)], device)
    params, grads = [base_p[0].t(), base_p[0][:, ::3]], [base_g[0].t(), base_g[0][:, ::3]]
    assert not params[0].is_contiguous() and not params[1].is_contiguous()
    assert_close_to_reference(params, grads, taylor_importance(params, grads))


def test_accumulate_adds_without_sync_and_out_overwrites(device):
    sizes = [100, 0, 40000]
    out = torch.full((3, 2), 123.0, device=device)
    expected = torch.zeros(3, 2, dtype=torch.float64)
    batches = [make_pairs(sizes, device) for _ in range(4)]
    taylor_importance(*batches[0], out=out)  # accumulate=False overwrites the 123s
    expected += reference.taylor_importance(*batches[0]).cpu()  # the reference stays on the inputs' device
    for params, grads in batches[1:]:
        result = taylor_importance(params, grads, out=out, accumulate=True)
        assert result is out
        expected += reference.taylor_importance(params, grads).cpu()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=1e-4)


PAIRS = [(p, g) for p in DTYPES for g in DTYPES]


@pytest.mark.parametrize("pdtype,gdtype", PAIRS)
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_exact_integers_every_dtype_pair_and_unaligned_views(device, pdtype, gdtype, shift):
    # Integer-valued products sum exactly in float32, so any dropped or doubled element (vector
    # tails, chunk edges, the misaligned head of a view x[shift:]) changes the result.
    sizes = [32768 * 2 + 13, 7, 32768, 1]
    params = [integer_valued(n + shift, device, pdtype, 5)[shift:] for n in sizes]
    grads = [integer_valued(n + shift, device, gdtype, 7, offset=2)[shift:] for n in sizes]
    assert all(p.is_contiguous() for p in params)
    exact = reference.taylor_importance(params, grads).cpu()
    assert exact[:, 1].max() < 2**24 and exact[0, 1] > 0
    assert torch.equal(taylor_importance(params, grads).double().cpu(), exact)


def test_all_empty_gradients(device):
    params, grads = make_pairs([0, (0, 5), 0], device)
    assert taylor_importance(params, grads).tolist() == [[0.0, 0.0]] * 3
    out = torch.full((3, 2), 2.5, device=device)
    taylor_importance(params, grads, out=out, accumulate=True)
    assert out.tolist() == [[2.5, 2.5]] * 3
    taylor_importance(params, grads, out=out)
    assert out.tolist() == [[0.0, 0.0]] * 3


def test_more_tensors_than_one_launch_holds(device):
    # The CUDA kernel takes at most 96 tensors of one dtype pair per launch: 250 same-dtype tensors
    # need three launches, each of whose rows must land in its own place.
    params = [torch.full((i % 13 + 1,), float(i + 1), device=device) for i in range(250)]
    grads = [torch.ones_like(p) for p in params]
    want = torch.tensor([[float((i + 1) * (i % 13 + 1))] * 2 for i in range(250)])
    assert torch.equal(taylor_importance(params, grads).cpu(), want)


@cuda_only
@pytest.mark.parametrize("pdtype,gdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_cpu_and_cuda_agree(pdtype, gdtype):
    # Both accumulate float32 within the same 32768-element chunks and float64 across them, in a
    # different order inside a chunk: |cpu - cuda| <= 1e-5 * Σ|θg| per row.
    params, grads = make_pairs([100_003, 32768, 5, 0, 4097], "cpu", pdtype, gdtype)
    cpu = taylor_importance(params, grads).double()
    cuda = taylor_importance([p.cuda() for p in params], [g.cuda() for g in grads]).double().cpu()
    bound = 1e-5 * reference.taylor_importance(params, grads)[:, 1:2] + 1e-30
    assert ((cpu - cuda).abs() <= bound).all(), (cpu, cuda)


@cuda_only
def test_cuda_graph_capture_and_replay():
    # No per-call allocation of metadata or host-to-device copy: the op can be captured, and a
    # replay reads the tensors' current values.
    params, grads = make_pairs([70_001, 3, 0, 40], "cuda", torch.bfloat16, torch.float32)
    out = torch.zeros(4, 2, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        taylor_importance(params, grads, out=out)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        taylor_importance(params, grads, out=out, accumulate=True)
    for g in grads:
        g.mul_(2)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    want = 2 * reference.taylor_importance(params, grads).cpu()
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-5, atol=1e-3)


@cuda_only
def test_torch_compile_reduce_overhead_replays_a_cuda_graph():
    """Under torch.compile(mode="reduce-overhead") (inductor's CUDA graphs) the op is captured and
    replayed: later calls read the tensors' current values."""
    params, grads = make_pairs([70_001, 3, 40], "cuda", torch.float32, torch.bfloat16)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def sums(ps, gs):
        return taylor_importance(ps, gs) * 1.0

    for _ in range(3):  # warm-up, recording, then replays
        got = sums(params, grads).clone()
    for g in grads:
        g.mul_(2)
    again = sums(params, grads).clone()
    torch.cuda.synchronize()
    want = reference.taylor_importance(params, grads).cpu()
    torch.testing.assert_close(got.double().cpu(), want / 2, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(again.double().cpu(), want, rtol=1e-5, atol=1e-3)


def test_bit_identical_repeats_and_thread_counts(device):
    params, grads = make_pairs([1_000_003, 77, 250_000], device, torch.bfloat16, torch.float32)
    first = taylor_importance(params, grads)
    for _ in range(3):
        assert torch.equal(taylor_importance(params, grads), first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(taylor_importance(params, grads), first)
    finally:
        torch.set_num_threads(threads)


def test_empty_list():
    assert taylor_importance([], []).shape == (0, 2)
    out = torch.zeros(0, 2)
    assert taylor_importance([], [], out=out, accumulate=True) is out


def test_nan_propagates_to_its_row_only(device):
    params, grads = make_pairs([10, 10], device)
    grads[1][3] = float("nan")
    got = taylor_importance(params, grads)
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all()


def test_parameters_with_requires_grad(device):
    lin = torch.nn.Linear(5, 3).to(device)
    lin(torch.randn(4, 5, device=device)).sum().backward()
    params = list(lin.parameters())
    got = taylor_importance(params, [p.grad for p in params])
    assert not got.requires_grad
    assert_close_to_reference(params, [p.grad for p in params], got)


@pytest.mark.skipif(
    not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck needs torch >= 2.4"
)
def test_opcheck(device):
    params, grads = make_pairs([7, (3, 4), 0], device, torch.float32, torch.bfloat16)
    torch.library.opcheck(torch.ops.adept_ext.taylor_importance.default, (params, grads))
    out = torch.zeros(3, 2, device=device)
    torch.library.opcheck(torch.ops.adept_ext.taylor_importance_out.default, (params, grads, out, True))


def test_torch_compile_fullgraph(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
    model(torch.randn(4, 8, device=device)).sum().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def normalized_abs_importance(ps, gs):
        sums = taylor_importance(ps, gs)
        return sums[:, 1] / sums[:, 1].sum()

    got = normalized_abs_importance(params, grads)
    exact = reference.taylor_importance(params, grads)[:, 1].cpu()
    torch.testing.assert_close(got.double().cpu(), exact / exact.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_single_tensor_over_2_to_the_31_elements(device):
    n = 2**31 + 17
    if device == "cpu":
        with open("/proc/meminfo") as f:
            available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        if available_kb * 1024 < 9 * n:
            pytest.skip("needs about 9 GB of available memory")
    elif torch.cuda.mem_get_info()[0] < 5 * n:
        pytest.skip("needs about 5 GB of free GPU memory")
    p = torch.zeros(n, dtype=torch.float16, device=device)
    p[5] = 2.0
    p[2**31 + 3] = 3.0  # beyond 32-bit indexing
    p[-1] = -1.0
    got = taylor_importance([p], [p])  # θ = g is allowed: θ·g = θ²
    assert got.tolist() == [[14.0, 14.0]]


# ---- errors: each raised before anything is written, naming the offending index ----

def test_error_length_mismatch():
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        taylor_importance([torch.ones(2), torch.ones(2)], [torch.ones(2)])


def test_error_grad_none():
    with pytest.raises(ValueError, match=r"grads\[1\] is None"):
        taylor_importance([torch.ones(2), torch.ones(2)], [torch.ones(2), None])


def test_error_shape_mismatch():
    with pytest.raises(ValueError, match=r"params\[1\] has shape \(2,\) but grads\[1\] has \(3,\)"):
        taylor_importance([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(3)])


@pytest.mark.parametrize("bad", [torch.float64, torch.int32])
def test_error_dtype(bad):
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype"):
        taylor_importance([torch.ones(2)], [torch.ones(2, dtype=bad)])


def test_error_not_a_tensor():
    with pytest.raises(TypeError, match=r"params\[0\] is a list"):
        taylor_importance([[1.0, 2.0]], [torch.ones(2)])


def test_error_device_mismatch():
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        taylor_importance([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(2, device="meta")])


@pytest.mark.parametrize("out", [torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.float64),
                                 torch.zeros(2, 4)[:, ::2], torch.zeros(2, 2, device="meta")])
def test_error_bad_out_leaves_it_untouched(out):
    before = out.clone()
    with pytest.raises(ValueError, match="out"):
        taylor_importance([torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(3)], out=out, accumulate=True)
    if out.device.type != "meta":
        assert torch.equal(out, before)


def test_error_accumulate_without_out():
    with pytest.raises(ValueError, match="accumulate=True needs an `out`"):
        taylor_importance([torch.ones(2)], [torch.ones(2)], accumulate=True)


def test_every_op_has_a_kernel_on_each_backend_the_build_claims():
    """cuda_available() (a bool) says whether this build has the CUDA kernels: then every op that
    csrc/ops.cpp declares has one (a .cu file left out of the build, or an m.impl missing, fails
    here), else none has; every op has a CPU kernel."""
    import re
    from pathlib import Path

    from adept_ext.ops.torch_internals import has_kernel

    names = re.findall(r'm\.def\("(\w+)\(', (Path(__file__).parents[1] / "csrc" / "ops.cpp").read_text())
    assert len(names) >= 8, names
    cuda = adept_ext.cuda_available()
    assert type(cuda) is bool
    assert [n for n in names if not has_kernel(f"adept_ext::{n}", "CPU")] == []
    assert [n for n in names if has_kernel(f"adept_ext::{n}", "CUDA") != cuda] == [], f"cuda_available() is {cuda}"


def test_raw_ops_are_not_differentiable(device):
    # No silent None gradient: a backward through the raw op raises, and the in-place variant
    # refuses inputs that require grad under grad mode (the wrapper reads them as data)
    params, grads = make_pairs([6, (2, 3)], device)
    params = [p.requires_grad_() for p in params]
    got = torch.ops.adept_ext.taylor_importance.default(params, grads)
    assert_close_to_reference(params, grads, got.detach())
    with pytest.raises(RuntimeError, match="adept_ext.taylor_importance is not differentiable"):
        got.sum().backward()
    out = torch.zeros(2, 2, device=device)
    with pytest.raises(RuntimeError, match="adept_ext.taylor_importance_out is not differentiable"):
        torch.ops.adept_ext.taylor_importance_out.default(params, grads, out, False)
    assert not out.any()
    with torch.no_grad():
        torch.ops.adept_ext.taylor_importance_out.default(params, grads, out, False)
    assert_close_to_reference(params, grads, out)


def test_out_bumps_its_version_counter(device):
    # `out` saved for a backward and then overwritten: that backward raises, as after out.add_()
    params, grads = make_pairs([5], device)
    out = torch.zeros(1, 2, device=device)
    w = torch.ones(1, 2, device=device, requires_grad=True)
    y = (w * out).sum()
    version = out._version
    taylor_importance(params, grads, out=out)
    assert out._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_opcheck_requires_grad(device):
    # test_aot_dispatch_dynamic is left out: it backpropagates through the op, which raises by
    # design (test_raw_ops_are_not_differentiable); test_opcheck runs it on plain inputs
    params, grads = make_pairs([7, (3, 4)], device)
    params = [p.requires_grad_() for p in params]
    torch.library.opcheck(torch.ops.adept_ext.taylor_importance.default, (params, grads),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
