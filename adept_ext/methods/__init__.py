"""Adaptation methods, one module each, behind one registry (see `base` for the protocol), each
configured by its own `MethodConfig` dataclass: `get_method(AdeptConfig(k=4))`, or
`create(name, options)` from a runner's flat options.

Single domain (`adept-ext run`): adept, full, llama_pro, freeze_deep, lora, adept_no_expand,
adept_uniform_lr. Task sequences (`adept-ext continual`): seq_full, seq_lora, replay, o_lora,
osf, adept_seq, llama_pro_seq, eoupct, deal, per_task (oracle), ewc, lwf, agem, merge_tasks.
"""
# Imported in the order the methods are listed in the CLI and the comparisons (registration order).
from . import adept, full, llama_pro, freeze_deep, lora, adept_no_expand, adept_uniform_lr  # noqa: F401, I001
from . import replay, o_lora, osf, adept_seq, eoupct, deal, per_task, ewc, lwf, agem, merge_tasks  # noqa: F401, I001
from .adept import AdeptConfig
from .agem import AgemConfig
from .adept_no_expand import AdeptNoExpandConfig
from .adept_seq import AdeptSeqConfig, LlamaProSeqConfig
from .adept_uniform_lr import AdeptUniformLrConfig
from .base import (REGISTRY, Context, Method, MethodConfig, MethodError, Setup, create, get_method, method_names,
                   register)
from .deal import DealConfig
from .eoupct import EoupCTConfig
from .ewc import EwcConfig
from .lwf import LwfConfig
from .merge_tasks import MergeTasksConfig
from .freeze_deep import FreezeDeepConfig
from .full import FullConfig, SeqFullConfig
from .llama_pro import LlamaProConfig
from .lora import LoraMethodConfig, SeqLoraConfig
from .o_lora import OLoraConfig
from .osf import OsfMethodConfig
from .per_task import PerTaskConfig
from .replay import ReplayConfig

__all__ = ["REGISTRY", "Context", "Method", "MethodConfig", "MethodError", "Setup", "create", "get_method",
           "method_names", "register",
           "AdeptConfig", "FullConfig", "LlamaProConfig", "FreezeDeepConfig", "LoraMethodConfig", "AdeptNoExpandConfig",
           "AdeptUniformLrConfig", "SeqFullConfig", "SeqLoraConfig", "ReplayConfig", "OLoraConfig", "OsfMethodConfig",
           "AdeptSeqConfig",
           "LlamaProSeqConfig", "EoupCTConfig", "DealConfig", "PerTaskConfig", "EwcConfig", "LwfConfig", "AgemConfig",
           "MergeTasksConfig"]
