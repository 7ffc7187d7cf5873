"""Load-time check that the Python-backend stub can exchange arrays with this Python's numpy.

Every input a request carries reaches `model.py` as a numpy array that the stub's C++ builds
around Triton's buffer (pybind11). Stubs built with a pybind11 that predates numpy 2's new
descriptor layout (every stub in the `nvidia-pytriton` 0.7.0 wheel, i.e. Triton 2.51, among
them) build those arrays wrongly under numpy >= 2: they read other memory, so the first BYTES
input (`text_input`) is parsed as garbage lengths and the stub process aborts
(`pybind11::error_already_set … unpack_from requires a buffer of at least … bytes`), after which
every request gets "Stub process … is not healthy".

`check_stub_arrays` runs the same C++ conversion once, at `initialize`, on a small known tensor
(`pb_utils.Tensor.from_dlpack(...).as_numpy()`, which wraps the tensor's memory in a numpy array
inside the stub) and raises `StubEnvironmentError`, naming what to install, when the values read
back differ, so such a model fails to load instead of dying on a user's first request.
"""

from __future__ import annotations

from typing import Any

# What to install, said once for the error and the README: the stub embeds the `python3` first
# on tritonserver's PATH and uses that interpreter's site-packages (it does not read PYTHONPATH).
NUMPY_REQUIREMENT = "numpy<2"


class StubEnvironmentError(RuntimeError):
    """The stub cannot work in this Python environment (the message says what to install)."""


def check_stub_arrays(pb_utils: Any) -> None:
    """Read a known uint8 tensor back through the stub's numpy conversion.

    Args:
        pb_utils: the stub's `triton_python_backend_utils` module.
    Raises:
        StubEnvironmentError: the values read back are not the values written (a stub built
            for numpy 1 running under numpy 2), with the fix in the message.
    """
    import numpy as np
    import torch

    expected = list(range(1, 17))
    probe = torch.tensor(expected, dtype=torch.uint8)
    got = pb_utils.Tensor.from_dlpack("mla_stub_probe", probe).as_numpy().tolist()
    if got == expected:
        return
    raise StubEnvironmentError(
        f"this Triton Python-backend stub cannot read tensors under numpy {np.__version__}: "
        f"a tensor holding {expected[:4]}... reads back as {got[:4]}..., so the first request "
        "would kill the stub. The stub was built for numpy 1 (as are all stubs of "
        "nvidia-pytriton 0.7.0 / Triton 2.51). Install numpy 1.x in the Python environment "
        "the stub runs, i.e. that of the `python3` first on tritonserver's PATH (the stub does "
        f"not read PYTHONPATH): `python3 -m pip install '{NUMPY_REQUIREMENT}'` "
        "(the project is tested with numpy 1.26.4); see the README, 'Serving on a GPU'."
    )
