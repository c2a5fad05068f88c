import pytest
import torch

from adept_ext import mean_importance, reference, taylor_importance


def test_per_tensor_and_per_unit_means_over_batches():
    sizes = [(4, 3), (5,), (2, 2)]
    sums = torch.zeros(3, 2)
    exact = torch.zeros(3, 2, dtype=torch.float64)
    for _ in range(3):
        params = [torch.randn(s) for s in sizes]
        grads = [torch.randn(s) for s in sizes]
        taylor_importance(params, grads, out=sums, accumulate=True)
        exact += reference.taylor_importance(params, grads)
    numels = [12, 5, 4]
    per_tensor = mean_importance(sums, numels, num_batches=3)
    torch.testing.assert_close(per_tensor.double(), exact / torch.tensor(numels)[:, None] / 3, rtol=1e-5, atol=1e-6)
    per_unit = mean_importance(sums, numels, groups=[1, 0, 1], num_batches=3)
    expect = torch.stack([exact[1] / 5, (exact[0] + exact[2]) / 16]) / 3
    torch.testing.assert_close(per_unit.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(numels=[1]), "2 rows of sums but 1 numels"),
    (dict(numels=[1, 1], groups=[0]), "1 group indices"),
    (dict(numels=[1, 1], groups=[0, -1]), "negative group"),
    (dict(numels=[1, 1], groups=[0, 2]), "group 1 has no elements"),
    (dict(numels=[0, 1]), "group 0 has no elements"),
    (dict(numels=[1, 1], num_batches=0), "num_batches"),
])
def test_mean_importance_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mean_importance(torch.zeros(2, 2), **kwargs)
