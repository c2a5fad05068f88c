"""Architecture families and model loading (docs/design.md, "Architectures").

`families`: the architecture table (`Family`, one per group of model types) and `adapter(model)`,
which finds a supported causal LM's decoder layers, norm, head and embeddings and computes the
fused head loss on them; `loading`: `load_model(name_or_dir)` from a local checkpoint, a cached
Hub id or the embedded default, offline, with its refusals, memory check and placement.
"""
from .families import (ATTENTION_CHOICES, ATTENTION_IMPLEMENTATIONS, FAMILIES, FAMILY_OF, LLAMA_PROJECTIONS,
                       REFUSED_ARCHITECTURES, SUPPORTED_ARCHITECTURES, Family, ModelAdapter, adapter, base_model,
                       family_of)
from .loading import (EMBEDDED_MODELS, HALF_DTYPES, cache_dir, check_attention, check_load_memory, check_own_code,
                      free_memory, load_model, loaded_bytes, place_model, resolve_attention, resolve_checkpoint,
                      stored_dtype)

__all__ = ["ATTENTION_CHOICES", "ATTENTION_IMPLEMENTATIONS", "EMBEDDED_MODELS", "FAMILIES", "FAMILY_OF", "HALF_DTYPES",
           "LLAMA_PROJECTIONS", "REFUSED_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "Family", "ModelAdapter",
           "adapter", "base_model", "cache_dir", "check_attention", "check_load_memory", "check_own_code", "family_of",
           "free_memory", "load_model", "loaded_bytes", "place_model", "resolve_attention", "resolve_checkpoint",
           "stored_dtype"]
