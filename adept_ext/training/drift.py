"""The live drift signal (docs/evaluation.md, "Drift from the base model"): the mean KL divergence
of the current model's next-token distributions from the base model's,

    KL = (1/N) Σ_i Σ_v p₀(v | x_<i) [log p₀(v | x_<i) − log p_θ(v | x_<i)]

over the first N labelled positions i of the held-out general rows (`--drift-tokens`). The base's
log-probabilities are computed once, at the base evaluation, and kept in float32 on the host
(N × V × 4 bytes); the current model's at each evaluation, from the final-norm outputs at those
positions only (the head applied to N rows, never to every position of the batch)."""
from typing import Dict, List, Sequence

import torch

from ..models import adapter, base_model, held
from ..lm_loss import IGNORE_INDEX, final_hidden
from ..models.packed_attention import packed_layout
from .loop import batch_to_device, vocab_size

CHUNK_ROWS = 256  # positions whose V logits are formed at once


def position_log_probs(model, batch: Dict[str, torch.Tensor], limit: int) -> torch.Tensor:
    """log p(v | x_<i) [n, V] in float32 at the first `limit` labelled positions i of `batch` (row-major;
    a position is labelled when the label of i + 1 is not IGNORE_INDEX, as the next-token loss counts
    it), from `model`'s own logits (`ModelAdapter.head_logits`: the head with Granite's scale and
    Gemma 2's soft-capping)."""
    batch = packed_layout(model, batch)
    labels = batch["labels"]
    with final_hidden(model) as caught:
        model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False,
              logits_to_keep=labels.new_empty(0))
    labelled = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX
    rows = caught[-1][labelled][:limit]
    head = adapter(base_model(model))
    return torch.cat([head.head_logits(r).float().log_softmax(-1) for r in rows.split(CHUNK_ROWS)]
                     ) if len(rows) else rows.new_zeros(0, vocab_size(model), dtype=torch.float32)


def kl_from_base(base: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Σ_v p₀(v) (log p₀(v) − log p(v)) per row of log-probabilities `base` and `current` [n, V] (a
    vocabulary entry the base gives probability 0 adds 0)."""
    p0 = base.exp()
    return torch.where(p0 > 0, p0 * (base - current), 0.0).sum(-1)


@torch.no_grad()
def base_distributions(model, batches: Sequence[Dict[str, torch.Tensor]], tokens: int, device) -> List[torch.Tensor]:
    """The reference of `mean_kl`: the log-probabilities of `model` (the base) at the first `tokens`
    labelled positions of `batches` (host batches, in order; fewer where they hold fewer), float32 on
    the host, one tensor per batch read; under bf16 autocast where the model holds bfloat16 weights
    (as `loop.evaluate` scores it)."""
    device, vocab, reference, left = torch.device(device), vocab_size(model), [], tokens
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            if left <= 0:
                break
            with held.autocast_for(model, device):
                log_probs = position_log_probs(model, batch_to_device(batch, device, vocab), left)
            reference.append(log_probs.cpu())
            left -= len(log_probs)
    finally:
        model.train(was_training)
    return reference


@torch.no_grad()
def mean_kl(model, batches: Sequence[Dict[str, torch.Tensor]], reference: List[torch.Tensor], device) -> float:
    """Mean KL(p₀ ‖ p_θ) of `model` over the positions of `reference` (`base_distributions` of the same
    `batches`), in float64 over positions."""
    device, vocab = torch.device(device), vocab_size(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch, base in zip(batches, reference):
            with held.autocast_for(model, device):
                current = position_log_probs(model, batch_to_device(batch, device, vocab), len(base))
            total += float(kl_from_base(base.to(device), current).double().sum())
            count += len(base)
    finally:
        model.train(was_training)
    return total / count if count else float("nan")
