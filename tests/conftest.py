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
