"""The drift signal (training/drift.py) against a direct computation from the models' full logits."""
import copy

import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext.training import drift


def direct_mean_kl(base, model, batches, tokens):
    """Mean over the first `tokens` positions i with labels[i + 1] != -100 of KL(p_base(·|x_≤i) ‖ p(·|x_≤i)),
    from each model's own `logits` (torch's kl_div: Σ p_base (log p_base − log p))."""
    per_position = []
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            lb = base(**inputs).logits.float().log_softmax(-1)[:, :-1]
            lc = model(**inputs).logits.float().log_softmax(-1)[:, :-1]
        scored = batch["labels"][:, 1:] != -100
        kl = torch.nn.functional.kl_div(lc, lb, log_target=True, reduction="none").sum(-1)
        per_position.append(kl[scored])
    return float(torch.cat(per_position)[:tokens].double().mean())


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: soft-capped logits
@pytest.mark.parametrize("tokens", [5, 40, 1000])  # inside one batch, across batches, more than the batches hold
def test_mean_kl_equals_the_direct_computation(arch, tokens):
    base = tiny_model(arch)
    model = copy.deepcopy(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    batches = padded_batches()
    reference = drift.base_distributions(base, batches, tokens, "cpu")
    assert sum(len(r) for r in reference) == min(tokens, sum(int((b["labels"][:, 1:] != -100).sum())
                                                          for b in batches))
    got = drift.mean_kl(model, batches, reference, "cpu")
    assert got > 0.01
    assert got == pytest.approx(direct_mean_kl(base, model, batches, tokens), rel=1e-5)
    assert drift.mean_kl(base, batches, reference, "cpu") == pytest.approx(0.0, abs=1e-6)


def test_kl_from_base_counts_a_token_the_base_never_predicts_as_zero():
    base = torch.tensor([[0.0, float("-inf")]])  # p0 = (1, 0)
    current = torch.tensor([[-0.1, -2.35]]).log_softmax(-1)
    assert drift.kl_from_base(base, current).item() == pytest.approx(-current[0, 0].item())
