"""The next-token loss of a causal LM through the fused `linear_cross_entropy` op, so that no
training or evaluation step holds the B×T×V logits (docs/design.md, "The training loss"):

    loss = Σ_{i: y_i ≠ −100} [logsumexp_v(W h_i)_v − (W h_i)_{y_i}] / #{i: y_i ≠ −100}

with h_i the final norm's output at position i (times Granite's 1 / logits_scaling), W the LM
head's weight and y the labels shifted by one (Hugging Face's `ForCausalLMLoss` with its mean
reduction: the same value, within 1e-5 relative in fp32).
The model still runs its own forward, through any DDP, FSDP2 or PEFT
wrapper (their hooks fire), asked for no logits (`logits_to_keep` is an empty index); a forward
hook on the final norm takes its output. A head that is not a plain linear map (a bias,
soft-capped or scaled logits, a wrapped head) would make the fused loss differ from the
model's own: `hf_head_reason` says why, and `implementation="auto"` then runs HF's loss.
"""
from contextlib import contextmanager
from typing import Dict, Optional

import torch

from .errors import InputError
from .models import adapter, base_model
from .models.packed_attention import packed_layout

LOSS_IMPLEMENTATIONS = ("auto", "fused", "hf")
IGNORE_INDEX = -100  # Hugging Face's label of a position that is not scored
# Config attributes that change the logits after the head's GEMM in a way the fused loss cannot
# reproduce, with their neutral value (Gemma 2/3: soft-capping; Cohere: logit_scale). Granite's
# division by logits_scaling is linear: the fused loss applies it to h (`ModelAdapter.logit_scale`).
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0}


def hf_head_reason(model) -> Optional[str]:
    """Why the fused loss would not equal `model`'s own loss, or None when it would: the LM head
    must be a plain `nn.Linear` without bias, no config attribute of LOGIT_TRANSFORMS may change
    the logits, and a mixture of experts must not add its router's auxiliary loss to `.loss`."""
    hf = base_model(model)
    head = adapter(hf).lm_head
    if type(head) is not torch.nn.Linear:
        return f"its LM head is a {type(head).__name__}, not a plain torch.nn.Linear"
    if head.bias is not None:
        return "its LM head has a bias"
    for attr, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(hf.config, attr, neutral)
        if value is not None and value != neutral:
            return f"its config transforms the logits ({attr}={value})"
    if getattr(hf.config, "output_router_logits", False):
        return "its loss includes the router's load-balancing loss (output_router_logits=True)"
    return None


def uses_fused_loss(model, implementation: str = "auto") -> bool:
    """Whether `next_token_loss(model, batch, implementation)` runs the fused loss ("auto": when
    `hf_head_reason` is None); InputError for an unknown implementation, or for "fused" on a head
    it cannot reproduce."""
    if implementation not in LOSS_IMPLEMENTATIONS:
        raise InputError(f"loss_implementation must be one of {', '.join(LOSS_IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    if implementation == "hf":
        return False
    reason = hf_head_reason(model)
    if reason and implementation == "fused":
        raise InputError(f"--loss-implementation fused cannot reproduce this model's loss: {reason}; "
                         "use auto or hf")
    return reason is None


def loss_path(model, implementation: str = "auto") -> str:
    """Which loss `next_token_loss` runs on `model`, and why, in words for the log."""
    if uses_fused_loss(model, implementation):
        return "the fused linear cross-entropy on the LM head (no B x T x V logits)"
    why = "--loss-implementation hf" if implementation == "hf" else hf_head_reason(model)
    return f"Hugging Face's loss on the full logits ({why})"


def labelled_tokens(batches) -> torch.Tensor:
    """The number of labelled next-token targets in `batches` (labels shifted by one, IGNORE_INDEX
    not counted), as a tensor on the batches' device (no host read)."""
    return sum((batch["labels"][..., 1:] != IGNORE_INDEX).sum() for batch in batches)


@contextmanager
def final_hidden(model):
    """Yields a list that receives the output of `model`'s final norm (the hidden states the LM
    head reads, [B, T, H], in the graph) on every forward inside the block."""
    caught = []
    handle = adapter(base_model(model)).final_norm.register_forward_hook(
        lambda module, args, output: caught.append(output))
    try:
        yield caught
    finally:
        handle.remove()


def next_token_loss(model, batch: Dict[str, torch.Tensor], implementation: str = "auto",
                    num_items=None) -> torch.Tensor:
    """The next-token loss of `batch` (input_ids, attention_mask, labels; or a packed row's input_ids,
    labels and position_ids, `data.packing`, in the layout `packed_layout` gives, every key passed to the
    model) under `model` (a Hugging Face causal LM, or one wrapped by DDP, FSDP2 or PEFT): the mean over
    its labelled tokens, or,
    given `num_items` (Hugging Face's `num_items_in_batch`: the labelled tokens of a whole
    optimizer step, a number or a tensor), the sum over them / `num_items`, so that micro-batches
    with different numbers of labelled tokens add up to the step's mean. Fused (see the module
    docstring) for "fused" and for "auto" when `hf_head_reason` is None, else `model(**batch).loss`."""
    batch = packed_layout(model, batch)
    if not uses_fused_loss(model, implementation):
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        return model(**batch, use_cache=False, **extra).loss
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ad = adapter(base_model(model))
    with final_hidden(model) as caught:
        model(**inputs, use_cache=False, logits_to_keep=labels.new_empty(0))
    hidden = caught[-1]
    targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    total = ad.head_loss_sum(hidden.reshape(-1, hidden.shape[-1]), targets)  # the fused op, Granite's scale on h
    return total / ((targets != IGNORE_INDEX).sum() if num_items is None else num_items)
