"""mla_backend: a DeepSeek-MLA LLM serving engine that runs inside Triton Inference Server.

Its triton-language kernels are the sibling package `mla_kernels` (shipped in the same wheel);
the developer tools (set-up, checkpoints, the tritonserver launcher) are `mla_tools`, which only a
checkout has.
"""
