"""Defaults chosen by the device: linear_cross_entropy's chunk and the probe's layer-call size."""
import pytest
import torch

from adept_ext import linear_cross_entropy, probe
from adept_ext.ops import GPU_MIN_CHUNK_ROWS, default_chunk_rows
from tiny_models import padded_batches, tiny_model


def test_cpu_chunk_is_the_kernels_default():
    # 2^23 logits, as csrc/linear_cross_entropy.h chose before: CPU speed unchanged
    assert default_chunk_rows(49152, torch.device("cpu"), torch.float32) == (1 << 23) // 49152
    assert default_chunk_rows(10**8, "cpu", torch.bfloat16) == 1


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


def test_default_chunk_gives_the_same_loss_on_cpu():
    h, w = torch.randn(300, 16), torch.randn(70000, 16)
    t = torch.randint(0, 70000, (300,))
    assert default_chunk_rows(70000, "cpu", torch.float32) == 119  # several chunks here
    torch.testing.assert_close(linear_cross_entropy(h, w, t), linear_cross_entropy(h, w, t, chunk_rows=119),
                               rtol=0, atol=0)


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
