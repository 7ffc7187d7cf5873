"""Triton Python-backend entry point: everything lives in `mla_backend.serving`.

Engine settings come from this model's config.pbtxt `parameters`; the weights from its
`weights/` folder (made by `python -m mla_tools.prepare`).
"""

from mla_backend.serving.triton_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
