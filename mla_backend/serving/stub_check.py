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
`check_stub_imports` does the same for transformers, which the model needs for its tokenizer:
under numpy 1 it fails to import where a package it pulls in was built for numpy 2 (seen: a SciPy
that needs numpy >= 2, which transformers 5.17 imports through scikit-learn).
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


def check_stub_imports() -> None:
    """Import what the model needs in the stub's Python (transformers' AutoTokenizer).

    Raises:
        StubEnvironmentError: the import failed; the message names its root cause and what to
            change in that Python environment.
    """
    import numpy as np

    try:
        from transformers import AutoTokenizer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure here is the environment's
        root: BaseException = e
        seen = {id(root)}
        while True:  # down the chain of causes (a context unless suppressed), without cycles
            nxt = root.__cause__ or (None if root.__suppress_context__ else root.__context__)
            if nxt is None or id(nxt) in seen:
                break
            root = nxt
            seen.add(id(root))
        raise StubEnvironmentError(
            f"transformers cannot be imported in the stub's Python (numpy {np.__version__}): "
            f"{type(e).__name__}: {e}; root cause: {type(root).__name__}: {root}. A package it "
            "imports was probably built for another numpy: the stub needs "
            f"'{NUMPY_REQUIREMENT}', so install versions built for numpy 1 of the packages "
            "that need numpy 2 (a SciPy that needs numpy >= 2 is imported by scikit-learn, "
            "which transformers imports when installed), or uninstall them, in the Python "
            "environment of the `python3` first on tritonserver's PATH; see the README, "
            "'Serving on a GPU'."
        ) from None
