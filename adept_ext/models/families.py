"""Architecture families and the adapter that finds a model's parts.

`adapter(model)` finds, for a supported Hugging Face causal LM, where the decoder layers,
final norm, LM head, embeddings and rotary embedding live, and what its `Family` declares:
which projections make a copied layer the identity, which per-layer config lists an expansion
must keep right, the LoRA targets, the attention backends and what the head does to the logits
(the fused head loss on it: `head_losses`, `head_loss_sum`). One family per architecture group
(Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2/3, Granite, SmolLM3, Ministral 3, and the
mixtures of experts Qwen3-MoE, Mixtral, OLMoE); the hybrid linear-attention and Mamba models are
refused by name (`REFUSED_ARCHITECTURES`).
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..errors import InputError
from ..ops import linear_cross_entropy, linear_cross_entropy_sum

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")  # transformers' attn_implementation names
# "auto": the backend transformers picks when given none (sdpa where the model class supports it, else eager).
ATTENTION_CHOICES = (*ATTENTION_IMPLEMENTATIONS, "auto")
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """What the library must know of one architecture family beyond the common layout
    (`model.model.layers`, `.norm`, `.embed_tokens`, `.rotary_emb`, `model.lm_head`; docs/design.md,
    "Architectures").

    `residual_outputs`: per residual branch of a decoder layer, the paths (modules with a weight
    and maybe a bias, or parameters) whose zeroing zeroes the branch, so a copy with them zeroed
    is the identity: o_proj and down_proj for Llama; also with Gemma's sandwich norms, OLMo 2's
    post-norms and Granite's residual multiplier, since an RMSNorm without bias of a zero vector
    is zero and 0·m = 0; in a mixture-of-experts layer every expert's down projection (one fused
    [E, H, I] tensor in transformers 5), in a dense one down_proj. Every branch needs one path
    present in each layer. `layer_lists`: config lists with one entry per layer, duplicated for
    a copy; `layer_index_lists`: config lists of layer indices, shifted (and the copy added
    beside its source). `lora_targets`: the projections LoRA adapts. `attention`: the attention
    backends transformers runs the family with."""

    model_types: Tuple[str, ...]
    residual_outputs: Tuple[Tuple[str, ...], ...] = (("self_attn.o_proj",), ("mlp.down_proj",))
    layer_lists: Tuple[str, ...] = ("layer_types",)
    layer_index_lists: Tuple[str, ...] = ()
    lora_targets: Tuple[str, ...] = LLAMA_PROJECTIONS
    attention: Tuple[str, ...] = ATTENTION_IMPLEMENTATIONS
    moe: bool = False


MOE_OUTPUTS = (("self_attn.o_proj",), ("mlp.experts.down_proj", "mlp.down_proj"))
FAMILIES = (
    Family(("llama", "mistral", "qwen2", "qwen3", "olmo2", "olmo3", "granite", "ministral3", "gemma3_text")),
    Family(("smollm3",), layer_lists=("layer_types", "no_rope_layers")),  # no_rope_layers[i]: layer i uses RoPE
    Family(("phi3",), lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # fused projections
    Family(("gemma2",), attention=("eager", "flash_attention_2")),  # transformers has no sdpa path for Gemma 2
    Family(("mixtral", "olmoe"), residual_outputs=MOE_OUTPUTS, moe=True),
    Family(("qwen3_moe",), residual_outputs=MOE_OUTPUTS, layer_index_lists=("mlp_only_layers",), moe=True),
)
FAMILY_OF = {model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED_ARCHITECTURES = tuple(FAMILY_OF)
# Architectures refused by name, with the reason (every other unknown model_type is refused too).
REFUSED_ARCHITECTURES = {
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
                    "its linear-attention layers (Gated DeltaNet, `linear_attn`) are not supported yet"),
    "granitemoehybrid": "its Mamba2 layers (`mamba`) are not supported yet",
    "falcon_h1": "its parallel attention + Mamba2 layers (FalconH1DecoderLayer) are not supported yet",
    **dict.fromkeys(("gemma4", "gemma4_text"), "its per-layer inputs, layer scalars and shared key/value layers "
                                               "are not supported yet"),
    "gemma3": "it is the multimodal Gemma 3 (Gemma3ForConditionalGeneration): load a text-only gemma3_text "
              "checkpoint instead",
}


def family_of(model_type: str) -> Family:
    """The family of `model_type`; InputError naming why an architecture is refused, or the supported ones."""
    if model_type in FAMILY_OF:
        return FAMILY_OF[model_type]
    if model_type in REFUSED_ARCHITECTURES:
        raise InputError(f"unsupported architecture {model_type!r}: {REFUSED_ARCHITECTURES[model_type]}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    raise InputError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass
class ModelAdapter:
    """Where the parts of a decoder-only HF model live, and what its family needs (`Family`)."""

    model: torch.nn.Module

    @property
    def config(self):
        return self.model.config

    @property
    def family(self) -> Family:
        return FAMILY_OF[self.config.model_type]

    @property
    def decoder(self):
        return self.model.model

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def logit_scale(self) -> float:
        """The factor the model applies to `lm_head(h)` (Granite divides by `logits_scaling`): the
        fused loss and the probe apply it to h, which is exact for a linear head."""
        return 1.0 / getattr(self.config, "logits_scaling", 1.0)

    @property
    def logit_softcap(self) -> Optional[float]:
        """c of Gemma 2's final soft-capping, logits = c·tanh(z / c) (None: no capping)."""
        return getattr(self.config, "final_logit_softcapping", None)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of final-norm outputs `hidden` (the head, Granite's scale, Gemma 2's
        soft-capping), in the head's dtype, as its own forward computes them."""
        return self.scaled_logits(self.lm_head(hidden))

    def head_logits_over(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`head_logits(hidden)[..., ids]`, computed from the head's rows `ids` only ([..., len(ids)]):
        a restricted softmax over a few tokens without the other V − len(ids) logits."""
        bias = getattr(self.lm_head, "bias", None)
        return self.scaled_logits(torch.nn.functional.linear(hidden, self.lm_head.weight[ids],
                                                             None if bias is None else bias[ids]))

    def scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output `logits` as the model's forward returns them: Granite's scale, Gemma 2's soft-capping."""
        logits = logits * self.logit_scale if self.logit_scale != 1 else logits
        return logits if self.logit_softcap is None else torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    def head_losses(self, rows: torch.Tensor, targets: torch.Tensor, chunk_rows: Optional[int] = None) -> torch.Tensor:
        """Per-row cross-entropy of the model's own logits of final-norm outputs `rows` [N, H]:
        the fused `linear_cross_entropy` on `rows · logit_scale` (never [N, V]); with Gemma 2's
        soft-capping, which is not linear, the capped logits chunk_rows rows at a time (the
        probe's and the lens's no-grad use)."""
        if self.logit_softcap is None:
            rows = rows * self.logit_scale if self.logit_scale != 1 else rows
            return linear_cross_entropy(rows, self.lm_head.weight, targets, chunk_rows=chunk_rows)
        chunk = chunk_rows or 1024
        losses = [torch.nn.functional.cross_entropy(self.head_logits(r).float(), t, reduction="none")
                  for r, t in zip(rows.split(chunk), targets.split(chunk))]
        return torch.cat(losses) if losses else rows.new_zeros(0, dtype=torch.float32)

    def head_loss_sum(self, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Σ of `head_losses` (float32 scalar), the training loss's numerator: the fused
        `linear_cross_entropy_sum` (its gradients computed in the forward: one GEMM fewer per step)
        where the head is linear, else the soft-capped rows' sum."""
        if self.logit_softcap is not None:
            return self.head_losses(rows, targets).sum()
        rows = rows * self.logit_scale if self.logit_scale != 1 else rows
        return linear_cross_entropy_sum(rows, self.lm_head.weight, targets)

    def residual_outputs(self, layer) -> List[torch.Tensor]:
        """The tensors (weights and biases) whose zeroing makes `layer` the identity (`Family`);
        InputError when a branch has none of its paths in this layer."""
        found = []
        for branch in self.family.residual_outputs:
            tensors = []
            for path in branch:
                try:
                    module = layer.get_submodule(path)
                except AttributeError:
                    try:
                        tensors.append(layer.get_parameter(path))
                    except AttributeError:
                        continue
                else:
                    tensors += [t for t in (module.weight, getattr(module, "bias", None)) if t is not None]
            if not tensors:
                raise InputError(f"{type(layer).__name__} has none of {', '.join(branch)}: cannot make a copy of it "
                                 "the identity")
            found += tensors
        return found


def base_model(model):
    """The Hugging Face model inside a DDP or PEFT wrapper (an FSDP2 model is itself)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def adapter(model) -> ModelAdapter:
    """The adapter of a supported model (a DistributedDataParallel wrapper is looked through);
    InputError naming the supported architectures (and why a known one is refused) otherwise."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    config = getattr(model, "config", None)
    family_of(getattr(config, "model_type", None))
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise InputError(f"{type(model).__name__} is not a causal LM with .model.layers and .lm_head "
                         "(load it with AutoModelForCausalLM)")
    return ModelAdapter(model)
