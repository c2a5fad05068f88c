import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Hugging Face datasets (file corpora) caches under a throw-away directory, not the user's cache,
# removed when the session ends (subprocesses inherit the variable and make none of their own).
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="adept-ext-test-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import adept_ext

# Under pytest-xdist (`-n 2`) each worker takes its share of the cores, so that two torch thread pools
# do not fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

GPU_PRESENT = torch.cuda.is_available()
NOT_COMPILED = ("a GPU is present but adept_ext was built without its CUDA kernels "
                "(adept_ext.cuda_available() is False): rebuild with ADEPT_EXT_CUDA=1")
try:
    CUDA_KERNELS = adept_ext.cuda_available()
except RuntimeError as e:  # compiled for other GPU architectures than the one present: skip, and say why
    CUDA_KERNELS, NOT_COMPILED = False, f"the CUDA kernels cannot run on this GPU: {e}"

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


class RecordingBar:
    """Stands in for tqdm: records, at every update, how many decoder-layer calls had run."""

    def __init__(self, iterable=None, total=None, layer_calls=None, **kwargs):
        self.iterable, self.total, self.layer_calls, self.n, self.ticks = iterable, total, layer_calls, 0, []

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, n=1):
        self.n += n
        self.ticks.append(len(self.layer_calls))

    def close(self):
        pass

    def set_postfix(self, *args, **kwargs):
        pass


@pytest.fixture
def record_progress(monkeypatch):
    """record_progress(module, model) replaces `module.tqdm` and returns the list of bars it
    creates; each bar's `ticks` says how many of `model`'s decoder-layer calls preceded each tick."""
    def watch(module, model):
        bars, calls = [], []
        for layer in model.model.layers:
            layer.register_forward_hook(lambda *args: calls.append(1))

        def make(*args, **kwargs):
            bars.append(RecordingBar(*args, layer_calls=calls, **kwargs))
            return bars[-1]

        monkeypatch.setattr(module, "tqdm", make)
        return bars

    return watch
