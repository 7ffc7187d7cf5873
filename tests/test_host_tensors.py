"""`int64_tensor`: the same tensor as `torch.tensor(values, dtype=torch.int64)`, owning its memory,
with clear errors for what is not an int64; `int64_on`: the same values on a device."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from mla_backend.host_tensors import int64_tensor


@pytest.mark.parametrize("values", [[], [0], [5, -3, 2**63 - 1, -(2**63)], list(range(5000))])
def test_equals_torch_tensor(values) -> None:
    got = int64_tensor(values)
    want = torch.tensor(values, dtype=torch.int64)
    assert got.dtype == torch.int64 and got.shape == want.shape and got.device.type == "cpu"
    assert torch.equal(got, want)


def test_numpy_ints_and_ranges() -> None:
    assert int64_tensor([np.int64(7), np.int32(-2), 3]).tolist() == [7, -2, 3]
    assert int64_tensor(range(3, 6)).tolist() == [3, 4, 5]


def test_memory_outlives_the_call() -> None:
    tensors = [int64_tensor(list(range(i, i + 500))) for i in range(40)]
    gc.collect()
    for _ in range(100):  # new buffers must not land on the tensors' memory
        int64_tensor([-1] * 500)
    assert all(t.tolist() == list(range(i, i + 500)) for i, t in enumerate(tensors))


def test_errors() -> None:
    with pytest.raises(TypeError):
        int64_tensor([1.5])
    with pytest.raises(OverflowError):
        int64_tensor([2**63])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_int64_on_a_device(device) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mla_backend.host_tensors import int64_on

    got = int64_on([4, -1, 2**40], device)
    assert got.device.type == device and got.dtype == torch.int64
    assert got.tolist() == [4, -1, 2**40]
    assert int64_on([], device).shape == (0,)
