"""mla_backend: a DeepSeek-MLA LLM serving engine that runs inside Triton Inference Server.

Importing the package also makes the repository's top-level `kernels/` folder (triton-language
kernels and their torch twins) importable as `mla_kernels`: a different PyPI package is named
`kernels` (transformers may import it), so the folder is never imported under its own name. This
works the same for an editable install and for `PYTHONPATH=<repo>` (the GPU machine).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _register_kernels() -> None:
    if "mla_kernels" in sys.modules:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(
        "mla_kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:  # pragma: no cover - broken checkout
        raise ImportError(f"kernels package not found at {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mla_kernels"] = module
    spec.loader.exec_module(module)


_register_kernels()
