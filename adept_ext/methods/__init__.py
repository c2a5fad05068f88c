"""Adaptation methods, one module each, behind one registry (see `base` for the protocol).

Single domain (`adept-ext run`): adept, full, llama_pro, freeze_deep, lora, adept_no_expand,
adept_uniform_lr. Task sequences (`adept-ext continual`): seq_full, seq_lora, replay, o_lora,
adept_seq, llama_pro_seq, eoupct, deal, per_task (oracle).
"""
# Imported in the order the methods are listed in the CLI and the comparisons (registration order).
from . import adept, full, llama_pro, freeze_deep, lora, adept_no_expand, adept_uniform_lr  # noqa: F401, I001
from . import replay, o_lora, adept_seq, eoupct, deal, per_task  # noqa: F401, I001
from .base import REGISTRY, Context, Method, MethodError, Setup, create, method_names, register

__all__ = ["REGISTRY", "Context", "Method", "MethodError", "Setup", "create", "method_names", "register"]
