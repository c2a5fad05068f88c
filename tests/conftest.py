import pytest
import torch

import adept_ext

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and adept_ext.cuda_available() else [])


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
