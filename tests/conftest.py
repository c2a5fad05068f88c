import pytest
import torch

import adept_ext

GPU_PRESENT = torch.cuda.is_available()
CUDA_KERNELS = adept_ext.cuda_available()
NOT_COMPILED = ("a GPU is present but adept_ext was built without its CUDA kernels "
                "(adept_ext.cuda_available() is False): rebuild with ADEPT_EXT_CUDA=1")

if GPU_PRESENT and not CUDA_KERNELS:
    DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skip(reason=NOT_COMPILED))]
else:
    DEVICES = ["cpu"] + (["cuda"] if GPU_PRESENT else [])

# For tests that only mean something on a GPU (shared-memory limits, CUDA graphs, CPU<->CUDA agreement).
cuda_only = pytest.mark.skipif(not (GPU_PRESENT and CUDA_KERNELS),
                               reason=NOT_COMPILED if GPU_PRESENT else "needs a GPU and the CUDA kernels")


def integer_valued(n, device, dtype, period, offset=0):
    """n small nonzero integers (exact in float32, bfloat16 and float16) that vary along the
    tensor: with them the kernels' sums are exact, and every element changes the result."""
    x = (torch.arange(n, device=device) + offset) % period - period // 2
    return (x + (x >= 0).long()).to(dtype)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
