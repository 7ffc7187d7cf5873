"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny matmuls: one intra-op thread is ~10x faster than two on a busy 2-core machine; the
    previous thread count comes back after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
