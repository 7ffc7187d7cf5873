"""Developer tools of the checkout, not part of the engine nor of its wheel: set-up (`prepare`),
checkpoint makers (`checkpoints`, `tiny_deepseek`, `model_shapes`), the tiny model's training run
(`train_tiny_mla`) and the tritonserver launcher (`tritonserver`). Run from the repository root,
e.g. `python -m mla_tools.prepare`; they may import `mla_backend`, never the other way round.
"""
