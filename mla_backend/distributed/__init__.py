"""Tensor parallelism: the process-wide TP group and its collectives (`parallel_state`).

The TP layers that use it live in `layers/linear.py` (column/row-parallel linears) and
`layers/logits.py` (vocab-parallel embedding and LM head).
"""

from mla_backend.distributed.parallel_state import (
    destroy_tensor_parallel,
    divide,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    is_tensor_parallel_initialized,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "destroy_tensor_parallel",
    "divide",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "is_tensor_parallel_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
