"""triton-language kernels for mla_backend, plus their float32 torch twins in `reference.py`.

Imports torch and triton only; never `mla_backend`. Named `mla_kernels` so that it cannot collide
with the unrelated PyPI package `kernels` (which transformers imports when it is installed).
"""
