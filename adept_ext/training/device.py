"""Where a run trains and in what precision, and whether it fits in memory."""
import resource
from contextlib import contextmanager
from typing import Collection, Dict

import torch

from .. import parallel
from ..models import adapter, free_memory, held, quantize
from ..optim import moment_bytes, step_bytes
from ..errors import RunError
from ..lm_loss import uses_fused_loss
from ..ops import default_chunk_rows


def device_for(cfg) -> torch.device:
    """cpu, or this process's GPU (cuda:LOCAL_RANK under torchrun), from `cfg.device` (auto | cpu | cuda)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda: no GPU is available")
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    return parallel.local_device(kind)


def use_bf16(cfg, device) -> bool:
    """Whether the run trains under bf16 autocast (`cfg.bf16`: auto = on a GPU that supports it;
    on = also on the CPU, whose autocast runs matrix products in bfloat16)."""
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.bf16 == "on" and device.type == "cuda" and not supported:
        raise RunError("--bf16 on needs a GPU with bfloat16 support")
    return cfg.bf16 == "on" or (cfg.bf16 == "auto" and supported)


def frozen_dtype_for(cfg, bf16: bool) -> torch.dtype:
    """The dtype the weights that do not train are held in during a task (`cfg.frozen_dtype`):
    bfloat16 (auto, and nf4 for what is not a linear layer of the decoder: when the steps run under
    bf16 autocast, and not under FSDP2, whose all-gather wants one dtype per layer) or float32.
    Trainable weights and their gradients stay float32, and so do AdamW's moments unless `--optim`
    holds them in 8 bits (docs/design.md, "Precision")."""
    if cfg.frozen_dtype == "bfloat16":
        if not bf16:
            raise RunError("--frozen-dtype bfloat16 needs bf16 autocast (--bf16 on, or auto on a GPU with bfloat16): "
                           "a float32 activation cannot multiply a bfloat16 weight outside autocast")
        return torch.bfloat16
    return torch.bfloat16 if cfg.frozen_dtype in ("auto", "nf4") and bf16 and cfg.parallel != "fsdp2" else torch.float32


def hold_frozen(model, dtype: torch.dtype, keep: Collection[torch.nn.Parameter] = ()) -> int:
    """Hold every floating-point parameter of `model` that does not require grad, but those in
    `keep`, in `dtype` until `held.release` (`held.hold`: the exact value on the host where the cast
    rounds); returns how many the model holds. So evaluation, merging and saving after the steps can
    see the weights the task started from, bit for bit (docs/design.md, "Precision")."""
    kept = {id(p) for p in keep}
    return held.hold(model, [p for p in model.parameters() if not p.requires_grad and id(p) not in kept], dtype)


def release_held(model, since: int = 0):
    """Everything held put back exact on the device: the 4-bit layers (`quantize.release_nf4`), then
    the weights held after the first `since` records (`held.release`)."""
    quantize.release_nf4(model)
    held.release(model, since)


def export_held(model):
    """The whole model on the host, every held weight exact there (the 4-bit layers put back there,
    `quantize.release_nf4`, then `held.export_exact`), never in float32 on the device: for merging
    and saving after `run`'s task."""
    quantize.release_nf4(model, "cpu")
    held.export_exact(model, "cpu")


@contextmanager
def held_as_frozen(model, cfg, bf16: bool):
    """The whole model held as a task holds the weights that do not train, as if none trained
    (`hold_frozen` at `frozen_dtype_for`; with --frozen-dtype nf4 every linear layer of the decoder
    in 4 bits, `quantize.hold_nf4`, quantised from its exact weights), as before on exit (what the
    load held stays held): the base model as the steps will see it."""
    trains = [p.requires_grad for p in model.parameters()]
    nf4 = cfg.frozen_dtype == "nf4"
    since = len(held.records(model))  # what was held before (from the load on) stays held
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        hold_frozen(model, frozen_dtype_for(cfg, bf16), keep=quantize.frozen_linear_parameters(model) if nf4 else ())
        if nf4:
            quantize.hold_nf4(model, torch.bfloat16 if bf16 else torch.float32)
        yield model
    finally:
        release_held(model, since)
        for p, grad in zip(model.parameters(), trains):
            p.requires_grad_(grad)


def exact_host_bytes(model) -> int:
    """Bytes of the exact values kept on the host while weights are held (`hold_frozen`, and the
    layers `quantize.hold_nf4` replaced): on the CPU, the same memory as the device's."""
    return held.held_bytes(model) + quantize.exact_bytes(model)


def memory_estimate(cfg, model, bf16: bool = False, trainable: int = 0, shards: int = 1,
                    device=None, method_bytes: int = 0) -> Dict[str, int]:
    """Bytes a training step needs: the weights as held (frozen ones may be bfloat16, `hold_frozen`,
    or 4-bit with their quantisation constants, `quantize.hold_nf4`; on the CPU also the exact
    copies these keep on the host, `exact_host_bytes`), the float32 gradient and the
    optimizer's two moments (`optim.moment_bytes`: float32, or 8-bit) of the `trainable` parameters
    (divided among `shards` ranks under FSDP2; the gradient only with --grad-accum 1, since the
    micro-batches before a step's last accumulate it unsharded) and its step's temporary (`optim.step_bytes`), and
    one micro-batch's activations (halved under bf16 autocast; with --gradient-checkpointing each
    layer's input and one layer's activations). The fused
    loss holds one chunk of logits instead of the micro-batch's B×T×V (its size on `device`,
    default the run's), and, when the LM head trains, its float32 gradient [V, H] from the forward to
    the backward. `method_bytes` (`Method.extra_bytes`: replay's slow copy) counts with the optimizer."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + quantize.held_bytes(model)
    if (device or device_for(cfg)).type == "cpu":  # the exact copies of held weights share the CPU's memory
        weights += exact_host_bytes(model)
    # trainable embedding weights keep float32 moments under an 8-bit optimizer (as in HF's Trainer)
    embeddings = min(trainable, sum(m.weight.numel() for m in model.modules()  # none where nothing trains yet
                                    if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad))
    moments = int((trainable - embeddings) * moment_bytes(cfg.optim) + embeddings * moment_bytes("adamw_torch"))
    # the float32 gradient: sharded, but whole on each rank under FSDP2 while micro-batches accumulate unsynced
    gradient = trainable * 4 // (1 if shards > 1 and cfg.grad_accum > 1 else shards)
    optimizer = gradient + moments // shards + step_bytes(cfg.optim, trainable // shards) + method_bytes
    fused = uses_fused_loss(model, cfg.loss_implementation)  # logits: one chunk (fp32 and its softmax), or all
    logits = 0 if fused else 8 * c.vocab_size
    layer = 4 * (16 * c.hidden_size + 4 * c.intermediate_size)  # one decoder layer's saved activations
    if cfg.gradient_checkpointing:  # each layer's input, and one layer recomputed at a time
        per_token = 4 * c.num_hidden_layers * c.hidden_size + layer + logits
    else:
        per_token = c.num_hidden_layers * layer + logits
    activations = cfg.batch_size * cfg.max_length * per_token // (2 if bf16 else 1)
    if fused:
        activations += 8 * c.vocab_size * default_chunk_rows(c.vocab_size, device or device_for(cfg), torch.float32,
                                                                 grad=True)
        head = adapter(model).lm_head.weight
        if head.requires_grad and trainable:  # the fused loss computes the head's gradient in the forward and holds
            activations += 4 * head.numel()   # it in float32 until the backward (2.1 GB at Llama-3-8B's [128256, 4096])
    return {"weights": weights, "optimizer": optimizer, "activations": activations}


def check_memory(cfg, model, bf16: bool = False, trainable: int = 0, shards: int = 1, method_bytes: int = 0):
    """Refuse a run that will not fit in the available memory (`memory_estimate`). Called before
    anything is written (trainable = 0: can the model run at all?) and again once the method has
    chosen what trains and the frozen weights are held in their dtype. The estimate is in the message;
    returned (bytes per part and "total") where it fits."""
    estimate = memory_estimate(cfg, model, bf16, trainable, shards, method_bytes=method_bytes)
    weights, optimizer, activations = estimate["weights"], estimate["optimizer"], estimate["activations"]
    need = weights + optimizer + activations
    free = free_memory(device_for(cfg))  # on a GPU after what holding the frozen weights freed went back to the driver
    available = free + weights  # the weights (on the CPU with the exact copies beside held ones) are there already
    if need > available:
        advice = ("lower --batch-size and raise --grad-accum" if activations > optimizer
                  else "train fewer parameters (a smaller --k, a LoRA method) or use a device with more memory")
        gib = 2**30
        raise RunError(f"batch_size {cfg.batch_size} x max_length {cfg.max_length} with {trainable / 1e6:.1f}M "
                       f"trainable parameters needs about {need / gib:.1f} GiB (weights {weights / gib:.1f}, optimizer "
                       f"{optimizer / gib:.1f}, activations {activations / gib:.1f}) but {available / gib:.1f} GiB "
                       f"are available: {advice}")
    return {**estimate, "total": need}


def peak_memory_mb(device) -> float:
    """Peak memory of this process so far: allocated on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
