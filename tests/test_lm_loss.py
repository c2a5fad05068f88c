"""The fused next-token loss (adept_ext.lm_loss) against the model's own loss: values and
gradients on every supported architecture, tied and untied heads, padding; no full logits;
heads it cannot reproduce go to Hugging Face's path, and say so."""
import pytest
import torch
from tiny_models import ARCHS, padded_batches, tiny_model

from adept_ext.errors import InputError
from adept_ext.lm_loss import hf_head_reason, loss_path, next_token_loss, uses_fused_loss


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got, want, rel):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-12)
        assert float((got[name] - want[name]).abs().max() / scale) <= rel, name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_equals_hf_loss_and_gradients(arch, tie):
    """fp32: the loss within 1e-5 relative of `model(**batch).loss` (right padding, labels −100
    at the pads), every parameter's gradient (the head, and with a tied head the embeddings
    through both uses) within 1e-5 of the largest entry; Granite's logit scaling is applied to h.
    Gemma 2's soft-capped head cannot be fused: it runs the model's own loss, and says so."""
    model = tiny_model(arch, tie=tie).train()
    batch = padded_batches()[0]
    assert uses_fused_loss(model) == (arch != "gemma2")
    if arch == "gemma2":
        assert "final_logit_softcapping=30.0" in loss_path(model)
    want_loss = model(**batch).loss
    want = grads_of(model, want_loss)
    got_loss = next_token_loss(model, batch)
    got = grads_of(model, got_loss)
    assert float(got_loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-5)
    assert_same_grads(got, want, 1e-5)


def test_no_full_logits_are_formed():
    """The LM head is asked for no position (an empty `logits_to_keep`): its output has 0 rows."""
    model = tiny_model("llama")
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    next_token_loss(model, padded_batches()[0])
    assert shapes == [(3, 0, model.config.vocab_size)]


def test_under_a_peft_wrapper_and_for_an_unscored_row():
    """Through PEFT's PeftModel (a LoRA adapter): the same loss and adapter gradients as the
    model's own; a row whose labels are all −100 adds nothing."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model("qwen3"), LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                                                                init_lora_weights=False))
    batch = padded_batches()[0]
    batch["labels"][1] = -100
    want_loss = peft_model(**batch).loss
    want = grads_of(peft_model, want_loss)
    got_loss = next_token_loss(peft_model, batch, "fused")
    got = grads_of(peft_model, got_loss)
    assert float(got_loss.detach()) == pytest.approx(float(want_loss.detach()), rel=1e-5)
    assert_same_grads(got, want, 1e-5)


def test_a_head_with_a_bias_runs_hf_loss_and_says_why():
    """A head the fused op cannot reproduce (here a bias; soft-capped or scaled logits alike):
    "auto" runs the model's own loss and names the reason, "fused" is refused."""
    model = tiny_model("llama")
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    batch = padded_batches()[0]
    assert hf_head_reason(model) == "its LM head has a bias"
    assert not uses_fused_loss(model, "auto")
    assert "Hugging Face's loss" in loss_path(model) and "bias" in loss_path(model)
    assert float(next_token_loss(model, batch)) == float(model(**batch).loss)
    with pytest.raises(InputError, match="fused cannot reproduce this model's loss: its LM head has a bias"):
        next_token_loss(model, batch, "fused")


@pytest.mark.parametrize("attr,value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5)])
def test_logit_transforms_in_the_config_route_to_hf(attr, value):
    model = tiny_model("llama")
    setattr(model.config, attr, value)
    assert hf_head_reason(model) == f"its config transforms the logits ({attr}={value})"
    with pytest.raises(InputError, match=attr):
        uses_fused_loss(model, "fused")


def test_a_router_auxiliary_loss_routes_to_hf():
    """A mixture of experts whose config adds the load-balancing loss to `.loss`
    (output_router_logits=True) runs the model's own loss, which then differs from the plain
    next-token loss the fused path would give."""
    model = tiny_model("qwen3_moe")
    batch = padded_batches()[0]
    plain = float(next_token_loss(model, batch))
    model.config.output_router_logits = True
    assert "output_router_logits=True" in hf_head_reason(model)
    with_aux = float(next_token_loss(model, batch))
    assert with_aux == float(model(**batch).loss) and with_aux != plain


def test_hf_on_request_and_an_unknown_name():
    model = tiny_model("llama")
    assert not uses_fused_loss(model, "hf")
    assert "--loss-implementation hf" in loss_path(model, "hf")
    with pytest.raises(InputError, match="loss_implementation must be one of auto, fused, hf"):
        next_token_loss(model, padded_batches()[0], "liger")


def test_bf16_autocast_matches_hf_within_bf16_rounding():
    """Under bf16 autocast (the training loop's), the fused loss runs its GEMM in bf16 as HF's
    lm_head does; the two agree to bf16 rounding."""
    model = tiny_model("llama")
    batch = padded_batches()[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(**batch).loss, next_token_loss(model, batch)
    assert float(got) == pytest.approx(float(want), rel=2e-2)


def uneven_rows(counts=(7, 1, 0)):
    """One-row batches of 8 tokens with `counts` labelled next-token targets each, and the batch of them all."""
    ids = torch.randint(2, 97, (len(counts), 8), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    for i, n in enumerate(counts):
        labels[i, :8 - n] = -100  # the first position's label is never a target
    rows = [{"input_ids": ids[i:i + 1], "attention_mask": torch.ones(1, 8, dtype=torch.long),
             "labels": labels[i:i + 1]} for i in range(len(counts))]
    return rows, {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def accumulated_step(model, rows, grad_accum, implementation, wrapped=None):
    """One `train_steps` step of the full method over `rows` (`grad_accum` micro-batches per rank;
    `wrapped`: the DDP module to run): (the logged loss, the gradients the optimizer saw)."""
    from types import SimpleNamespace

    from adept_ext.methods import FullConfig, get_method
    from adept_ext.methods.task import prepare
    from adept_ext.training.loop import train_steps

    task = prepare(model, get_method(FullConfig()), lr=1.0, total_steps=1, progress=False,
                   loss_implementation=implementation)
    seen = {}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    optimizer = Recording(task.param_groups, lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cfg = SimpleNamespace(steps=1, grad_accum=grad_accum, logging_steps=1, max_grad_norm=0.0, batch_size=1,
                          max_length=8, dataloader_num_workers=0)
    history = {"train": []}
    train_steps(wrapped or model, task, optimizer, scheduler, rows, cfg, "cpu", False, history, 0, "step", False,
                after_step=lambda step: None)
    return history["train"][0]["loss"], seen["grads"]


@pytest.mark.parametrize("implementation", ["fused", "hf"])
def test_a_steps_loss_is_the_mean_over_its_labelled_tokens(implementation):
    """`train_steps` with gradient accumulation over micro-batches with 7, 1 and 0 labelled tokens:
    the step's gradients and logged loss equal one batch of the three rows (the mean over its 8
    labelled tokens), not the mean of the micro-batches' means (the normalisation before), and the
    micro-batch without one adds 0 rather than NaN. Under DDP: tests/test_distributed.py."""
    rows, whole = uneven_rows()
    model = tiny_model("llama")
    want_loss = next_token_loss(model, whole, implementation)
    want = grads_of(model, want_loss)
    model.zero_grad(set_to_none=True)
    loss, grads = accumulated_step(model, rows, 3, implementation)
    assert loss == pytest.approx(float(want_loss.detach()), rel=1e-5)
    assert_same_grads(grads, want, 1e-5)
