"""adept_ext: C++/CUDA kernels and tools for continual pretraining without catastrophic forgetting.

One task with any method in your own loop: `get_method(config)` then `prepare(model, method, ...)`.
See README.md for the API, docs/methods.md for the methods and docs/design.md for the design.
"""
import torch  # noqa: F401  (the compiled library links against torch: import it first)

from . import _cuda_arch

__version__ = "0.1.0"  # the one place of the version: pyproject.toml reads this literal


def _refuse_unsupported_torch() -> None:
    """ImportError (one line) for a torch outside the tested range, or another major.minor than the
    build's, before the compiled library is loaded (a library built against another torch fails to
    load with an undefined symbol, or loads and crashes later)."""
    import os

    try:
        from . import _build_info
        built_with = getattr(_build_info, "TORCH_VERSION", None)  # None: a build that predates the record
    except ImportError:
        built_with = None
    problem = _cuda_arch.torch_problem(torch.__version__, built_with,
                                       allow_untested=os.environ.get(_cuda_arch.UNTESTED_TORCH_ENV) == "1")
    if problem:
        raise ImportError(problem)


_refuse_unsupported_torch()

from . import _C  # noqa: F401  (loads the shared object, which registers torch.ops.adept_ext)
from . import ops, reference  # noqa: F401
from .methods import get_method
from .methods.task import Task, prepare
from .ops import check_cuda_device, compiled_cuda_arch_list, linear_cross_entropy, taylor_importance
from .ops.torch_internals import has_kernel
from .adept.units import mean_importance

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


def _notice_cpu_only_build() -> None:
    """One warning when this build has no CUDA kernels but a CUDA GPU is visible (its ops cannot run
    on it); silent on a machine without a GPU, where CPU kernels are all there is to use."""
    if torch.version.cuda is not None and not has_kernel("adept_ext::taylor_importance", "CUDA") \
            and torch.cuda.is_available():
        import warnings

        warnings.warn("adept_ext was built with CPU kernels only, so its ops cannot run on the visible CUDA GPU: "
                      "rebuild it with a CUDA toolkit and ADEPT_EXT_CUDA=1 (docs/install.md)", stacklevel=2)


_notice_cpu_only_build()
