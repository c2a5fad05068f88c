"""Defaults chosen by the device: linear_cross_entropy's chunk and the probe's layer-call size."""
import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext import linear_cross_entropy, ops, reference
from adept_ext.adept import probe
from adept_ext.ops import GPU_MIN_CHUNK_ROWS, cross_entropy, default_chunk_rows


def test_cpu_chunk_is_the_kernels_default():
    # 2^23 logits, as csrc/linear_cross_entropy.h chose before: CPU speed unchanged
    assert default_chunk_rows(49152, torch.device("cpu"), torch.float32) == (1 << 23) // 49152
    assert default_chunk_rows(10**8, "cpu", torch.bfloat16) == 1
    # with gradients, 2^25: the weight gradient's GEMM needs the rows (docs/benchmarks.md)
    assert default_chunk_rows(49152, "cpu", torch.float32, grad=True) == (1 << 25) // 49152 == 682


@pytest.mark.parametrize("vocab,dtype,rows", [
    (128256, torch.bfloat16, 1024),   # Llama-3 vocabulary: 251 MiB of bf16 logits
    (151936, torch.bfloat16, 1024),   # at least 1024 rows (297 MiB)
    (128256, torch.float32, 1024),
    (32000, torch.bfloat16, 4096),    # 256 MiB / (32000 * 2 B) = 4194 -> a multiple of 128
    (49152, torch.float16, 2688),
])
def test_gpu_chunk_is_a_large_gemm(vocab, dtype, rows):
    got = default_chunk_rows(vocab, torch.device("cuda"), dtype)
    assert got == rows and got >= GPU_MIN_CHUNK_ROWS and got % 128 == 0


def test_default_chunk_gives_the_reference_loss_on_cpu(monkeypatch):
    """With chunk_rows=None the op takes the documented CPU rule's chunk (2^23 logits: 119 rows at
    V = 70000, so 300 rows are 3 chunks), its loss is the plain-PyTorch reference's, and any other
    chunk (one row block of 7, one chunk of all 300 rows) gives the same loss."""
    vocab, rows = 70000, 300
    torch.manual_seed(0)
    h, w = torch.randn(rows, 16), torch.randn(vocab, 16)
    t = torch.randint(0, vocab, (rows,))
    t[::7] = -100  # ignored rows in every chunk
    rule = max(1, ops.CPU_CHUNK_LOGITS // vocab)
    assert ops.CPU_CHUNK_LOGITS == 1 << 23 and default_chunk_rows(vocab, "cpu", torch.float32) == rule == 119
    asked = []
    real = ops.default_chunk_rows

    def spy(*args):
        asked.append((*args, real(*args)))
        return asked[-1][-1]

    monkeypatch.setattr(cross_entropy, "default_chunk_rows", spy)
    got = linear_cross_entropy(h, w, t)
    assert asked == [(vocab, h.device, torch.float32, False, rule)]  # the rule, for this vocabulary, device and dtype
    monkeypatch.undo()
    torch.testing.assert_close(got.double(), reference.linear_cross_entropy(h, w, t), rtol=1e-5, atol=1e-4)
    assert got[::7].eq(0).all() and got.gt(0).sum() == rows - len(range(0, rows, 7))
    for chunk in (7, rows):
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_rows=chunk), got, rtol=1e-6, atol=1e-5)


def test_probe_layer_call_size_by_device(monkeypatch):
    seen = []
    real = probe._bypass_sums

    def spy(ad, batch, chunk_rows, max_tokens_per_call, *rest):
        seen.append(max_tokens_per_call)
        return real(ad, batch, chunk_rows, max_tokens_per_call, *rest)

    monkeypatch.setattr(probe, "_bypass_sums", spy)
    model, batches = tiny_model("llama"), padded_batches(n_batches=1)
    default = probe.layer_importance(model, batches, progress=False)
    explicit = probe.layer_importance(model, batches, max_tokens_per_call=36, progress=False)
    assert seen == [probe.DEFAULT_MAX_TOKENS_PER_CALL["cpu"], 36] and probe.DEFAULT_MAX_TOKENS_PER_CALL["cpu"] == 4096
    assert default.scores == pytest.approx(explicit.scores, rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="max_tokens_per_call"):
        probe.layer_importance(model, batches, max_tokens_per_call=0)
