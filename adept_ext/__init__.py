"""adept_ext: C++/CUDA kernels and tools for continual pretraining without catastrophic forgetting.

One task with any method in your own loop: `get_method(config)` then `prepare(model, method, ...)`.
See README.md for the API, docs/methods.md for the methods and docs/design.md for the design.
"""
import torch  # noqa: F401  (the compiled library links against torch: import it first)

from . import _C  # noqa: F401  (loads the shared object, which registers torch.ops.adept_ext)
from . import ops, reference  # noqa: F401
from .methods import get_method
from .methods.task import Task, prepare
from .ops import check_cuda_device, compiled_cuda_arch_list, linear_cross_entropy, taylor_importance
from .ops.torch_internals import has_kernel
from .units import mean_importance

__all__ = ["Task", "check_cuda_device", "compiled_cuda_arch_list", "cuda_available", "get_method",
           "linear_cross_entropy", "mean_importance", "ops", "prepare", "reference", "taylor_importance"]


def cuda_available() -> bool:
    """Whether the CUDA kernels were compiled into this build (says nothing about a GPU being
    present). Raises RuntimeError when they were, a GPU is visible, and the architectures they
    were compiled for cannot run on it (e.g. an sm_90 build on an A100)."""
    compiled = has_kernel("adept_ext::taylor_importance", "CUDA")
    if compiled and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            check_cuda_device(i)
    return compiled
