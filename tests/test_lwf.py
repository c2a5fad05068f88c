"""LwF (methods/lwf.py): its loss against a direct computation from both models' full logits."""
import copy

import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext.methods import Context, LwfConfig, get_method


@pytest.mark.parametrize("task_index", [0, 1])
def test_the_loss_mixes_cross_entropy_and_the_tempered_kl_to_the_previous_model(task_index):
    base = tiny_model("llama")
    previous = copy.deepcopy(base)  # the model after the previous task: the adapter's base
    method = get_method(LwfConfig(rank=2, alpha=0.3, temperature=2.0))
    method.prepare(base, Context(general_probe=[], task_index=task_index))
    model = method.peft_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    batch = padded_batches(n_batches=1)[0]
    got = method.loss(model, batch)
    out = model(**batch)
    if task_index == 0:  # nothing to distil from yet: seq_lora's loss
        torch.testing.assert_close(got, out.loss, rtol=1e-5, atol=0)
        return
    scored = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        teacher = previous(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1][scored]
    student = out.logits[:, :-1][scored]
    kl = torch.nn.functional.kl_div((student / 2.0).log_softmax(-1), (teacher / 2.0).log_softmax(-1),
                                    log_target=True, reduction="batchmean") * 4.0
    torch.testing.assert_close(got, 0.7 * out.loss + 0.3 * kl, rtol=1e-5, atol=0)
    got.backward()  # the teacher's forward is outside the graph: only the adapter gets gradients
    assert all((p.grad is not None) == ("lora_" in n) for n, p in model.named_parameters() if p.requires_grad)
