"""triton-language kernels for mla_backend, plus their float32 torch twins in `reference.py`.

Imports torch (and, for the kernels of later issues, triton) only; never `mla_backend`.
Imported as `mla_kernels` (importing `mla_backend` registers that name) so it cannot collide with
the unrelated PyPI package `kernels`.
"""
