"""Where a run trains and in what precision, and whether it fits in memory."""
import resource

import torch

from .. import parallel
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
    """Whether the run trains under bf16 autocast (`cfg.bf16`: auto = on a GPU that supports it)."""
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.bf16 == "on" and not supported:
        raise RunError("--bf16 on needs a GPU with bfloat16 support")
    return cfg.bf16 == "on" or (cfg.bf16 == "auto" and supported)


def check_memory(cfg, model, bf16: bool = False, trainable: int = 0, shards: int = 1):
    """Refuse a run that will not fit in the available memory: the weights, the gradient and two
    AdamW moments (fp32) of the `trainable` parameters (divided among `shards` ranks under FSDP2),
    and one micro-batch's activations (halved under bf16 autocast). Called before anything is
    written (trainable = 0: can the model run at all?) and again once the method has chosen what
    trains. The fused loss holds one chunk of logits instead of the micro-batch's B×T×V. The
    estimate is in the message."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = trainable * 4 * 3 // shards
    fused = uses_fused_loss(model, cfg.loss_implementation)  # logits: one chunk (fp32 and its softmax), or all
    logits = 0 if fused else 8 * c.vocab_size
    per_token = 4 * c.num_hidden_layers * (16 * c.hidden_size + 4 * c.intermediate_size) + logits
    activations = cfg.batch_size * cfg.block_len * per_token // (2 if bf16 else 1)
    if fused:
        activations += 8 * c.vocab_size * default_chunk_rows(c.vocab_size, device_for(cfg), torch.float32)
    need = weights + optimizer + activations
    if device_for(cfg).type == "cuda":
        available = torch.cuda.mem_get_info()[0] + weights  # the weights are already on the device
    else:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024
    if need > available:
        advice = ("lower --batch-size and raise --grad-accum" if activations > optimizer
                  else "train fewer parameters (a smaller --k, a LoRA method) or use a device with more memory")
        gib = 2**30
        raise RunError(f"batch_size {cfg.batch_size} x block_len {cfg.block_len} with {trainable / 1e6:.1f}M trainable "
                       f"parameters needs about {need / gib:.1f} GiB (weights {weights / gib:.1f}, optimizer "
                       f"{optimizer / gib:.1f}, activations {activations / gib:.1f}) but {available / gib:.1f} GiB "
                       f"are available: {advice}")


def peak_memory_mb(device) -> float:
    """Peak memory of this process so far: allocated on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
