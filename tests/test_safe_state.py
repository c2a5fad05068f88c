"""State files hold data, not code: a checkpoint or a Trainer state carrying a pickled callable is
refused without running it (torch.load with weights_only=True)."""
import base64
import io
import pathlib
import pickle
from types import SimpleNamespace

import pytest
import torch

from adept_ext.hf import MethodCallback
from adept_ext.training.checkpoint import read_checkpoint
from adept_ext.training.rundir import CHECKPOINT


class Payload:
    """Unpickling it would create `marker`: the code a malicious state file would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_checkpoint_with_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"world_size": 1, "method": Payload(str(marker))}, tmp_path / CHECKPOINT)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        read_checkpoint(tmp_path)
    assert not marker.exists()


def test_a_trainer_state_with_code_is_refused_unrun(tmp_path):
    marker, buffer = tmp_path / "ran", io.BytesIO()
    torch.save({"units": Payload(str(marker))}, buffer)
    callback = MethodCallback.__new__(MethodCallback)  # the state restored by the Trainer, as from trainer_state.json
    callback._task = lambda: SimpleNamespace(load_state_dict=lambda state: pytest.fail("loaded"))  # a weak reference
    callback.saved_state = base64.b64encode(buffer.getvalue()).decode("ascii")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        callback.on_step_begin(None, None, None)
    assert not marker.exists()
