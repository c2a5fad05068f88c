"""How a model's attention keeps the documents of a packed row apart (`--packing`, docs/data.md):
`packed_layout` gives a packed batch the layout the attention backend needs, and `packing_reason` /
`check_packing` run the model to see that no document reads another before a run trains on packed rows."""
from typing import Dict, Optional

import torch

from ..errors import InputError
from .families import base_model

# Attention backends that confine each document of a packed row by its position ids in any batch
# shape: transformers' masking_utils builds a block-diagonal causal mask per row
# (`find_packed_sequence_indices`). Flash attention reads them only in one flattened row.
ROW_MASKED_ATTENTION = ("sdpa", "eager")


def packed_layout(model, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`batch` in the layout `model`'s attention needs to keep packed documents apart. A packed batch
    (position ids and no attention mask, `data.packing`) of B > 1 rows is flattened into one row
    [1, B·L] unless the backend is one of ROW_MASKED_ATTENTION: flash attention takes its variable-length
    (per-document) path only for one row with restarting position ids and runs dense causal attention over
    each row otherwise (Hugging Face's `DataCollatorWithFlattening`, TRL's `padding_free`). Each row's
    first label is -100 and its position ids restart at 0, so the flattened row scores the same targets.
    Any other batch is returned as it is."""
    packed = "position_ids" in batch and "attention_mask" not in batch and batch["input_ids"].shape[0] > 1
    if not packed or base_model(model).config._attn_implementation in ROW_MASKED_ATTENTION:
        return batch
    return {k: v.reshape(1, -1) for k, v in batch.items()}


def packing_reason(model, batch_size: int = 2, autocast_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why `model` would let a document of a packed batch (`--packing`: position ids restarting at each
    document, no attention mask; `data.packing`) see another, or None when it would not. `batch_size`
    packed rows, each of two documents and a padding tail, are run in training's layout (`packed_layout`)
    and precision (`autocast_dtype`) twice, the first document of each row changed the second time: every
    other position's logits must stay the same, max |Δ| ≤ 16 ε · max |logit| with ε the compute dtype's
    machine epsilon (attention confined to each document never reads the changed tokens: dense models
    give Δ = 0 exactly, a mixture of experts a few roundings, because its experts' GEMMs group other
    tokens with these; attention across the boundary changes them by a large fraction of the logits)."""
    hf = base_model(model)
    weight = hf.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    lengths, width = (6, 5), 12
    rows = max(1, batch_size)
    ids = torch.randint(weight.shape[0], (rows, width), generator=generator)
    positions = torch.cat([torch.arange(n) for n in (*lengths, width - sum(lengths))]).repeat(rows, 1)
    changed = ids.clone()
    changed[:, :lengths[0]] = torch.randint(weight.shape[0], (rows, lengths[0]), generator=generator)
    was_training = hf.training
    hf.eval()
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, dtype=autocast_dtype,
                                             enabled=autocast_dtype is not None):
            logits = [hf(**packed_layout(hf, {"input_ids": tokens.to(weight.device),
                                               "position_ids": positions.to(weight.device)}),
                         use_cache=False).logits.reshape(rows, width, -1) for tokens in (ids, changed)]
    finally:
        hf.train(was_training)
    rest = [logit[:, lengths[0]:].float() for logit in logits]
    moved = float((rest[0] - rest[1]).abs().max() / rest[0].abs().max().clamp_min(1e-30))
    if moved > 16 * torch.finfo(autocast_dtype or weight.dtype).eps:
        backend = hf.config._attn_implementation
        return (f"its {backend} attention lets packed documents see each other (changing one document's tokens "
                f"changed the next document's logits by {moved:.2g} of the largest)")
    return None


def check_packing(model, batch_size: int = 2, autocast_dtype: Optional[torch.dtype] = None):
    """InputError when `packing_reason(model, batch_size, autocast_dtype)` says packed rows would attend
    across documents."""
    reason = packing_reason(model, batch_size, autocast_dtype)
    if reason:
        raise InputError(f"--packing cannot be used with this model: {reason}; train without --packing")
