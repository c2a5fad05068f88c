"""The compiled ops, one module per op (`taylor`, `cross_entropy`, `null_space`): its typed wrapper,
fake, autograd formula and autocast rule together; their argument checks (`checks`), what they share
(`registration`: the kernel library, the not-differentiable ops' autograd) and the one place private
torch APIs are used (`torch_internals`). See docs/design.md, "Conventions"."""
from .checks import BASIS_DTYPES, SUPPORTED_DTYPES, check_cuda_device, check_device_arch, compiled_cuda_arch_list
from .cross_entropy import (CPU_CHUNK_LOGITS, CPU_GRAD_CHUNK_LOGITS, GPU_CHUNK_BYTES, GPU_MIN_CHUNK_ROWS,
                            WEIGHT_GRAD_PATHS, default_chunk_rows, linear_cross_entropy, linear_cross_entropy_backward,
                            linear_cross_entropy_sum, weight_grad_path)
from .null_space import (conflict_correct_, null_space_apply_, null_space_apply_prechecked_, null_space_coeffs,
                         null_space_coeffs_prechecked)
from .taylor import taylor_importance

__all__ = ["BASIS_DTYPES", "CPU_CHUNK_LOGITS", "CPU_GRAD_CHUNK_LOGITS", "GPU_CHUNK_BYTES", "GPU_MIN_CHUNK_ROWS",
           "SUPPORTED_DTYPES", "WEIGHT_GRAD_PATHS", "check_cuda_device", "check_device_arch",
           "compiled_cuda_arch_list", "conflict_correct_", "default_chunk_rows", "linear_cross_entropy",
           "linear_cross_entropy_backward", "linear_cross_entropy_sum", "null_space_apply_",
           "null_space_apply_prechecked_", "null_space_coeffs", "null_space_coeffs_prechecked", "taylor_importance",
           "weight_grad_path"]
