"""Kernel-test setup: run triton kernels in the interpreter when there is no CUDA device.

`TRITON_INTERPRET=1` must be set before triton is first imported (triton reads it at import),
so this is done at the very top, before anything imports triton, torch's triton helpers or the
kernels. On a CUDA machine it is left unset so kernels compile for real. Tests get
their device from the `device` fixture (or `DEVICE`): "cuda" when available, else "cpu".
"""

from __future__ import annotations

import os


def _cuda_available() -> bool:
    # torch is importable without triton; torch.cuda.is_available() does not import triton.
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    """"cuda" when a CUDA device is present, else "cpu" (kernels under TRITON_INTERPRET=1)."""
    return DEVICE
