"""`AttentionBackend`: the interface every attention implementation provides.

A backend reads and writes the KV pool of the `ForwardBatch` it is given, through
`req_to_token[req_pool_idx, position] -> slot`. Plan/run split (flashinfer style):
`init_forward_metadata` runs once per step, before the model; `forward_extend`/`forward_decode`
run once per attention layer. CUDA-graph hooks are part of the interface for later backends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch
    from mla_backend.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    # Whether models may store absorbed-MLA decode's new latent rows in the pool themselves
    # (`mla_kernels.mla_rope_store`, fused with the latent norm and rope) and then call
    # `forward_decode` with k = v = None and save_kv_cache=False. The triton backend says yes;
    # the reference backend keeps the separate torch ops, so it stays an independent oracle.
    fused_mla_prologue: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Prepare per-step metadata (index tensors, split plans). Called once per forward."""

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for new tokens over each request's cached prefix plus its new tokens (causal).

        Args:
            q: [T, layer.num_heads, layer.head_dim].
            k: [T, layer.num_kv_heads, layer.head_dim] new keys (None: already in the pool).
            v: [T, layer.num_kv_heads, layer.v_head_dim] new values (None: already in the pool,
               or, for MLA latent pools, derived from k by the pool).
            save_kv_cache: write k/v to the pool at forward_batch.out_cache_loc first.
               With `layer.pool_free` (decompressed MLA prefill) means: attend only
               over the given new k/v, read nothing from the pool.
        Returns:
            [T, layer.num_heads * layer.v_head_dim], dtype of q.
        """

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """One new token per request over all of its cached tokens. Shapes as forward_extend."""


def check_pool_free(k: torch.Tensor | None, v: torch.Tensor | None,
                    forward_batch: "ForwardBatch") -> None:
    """The preconditions of a `layer.pool_free` extend, which every backend checks the same way:
    the new k and v are given (they are all the layer attends over) and no request has a cached
    prefix (its tokens would be in the pool, which pool_free attention does not read).

    Raises:
        ValueError: k or v is None, or a request has a cached prefix.
    """
    if k is None or v is None:
        raise ValueError("pool_free attention needs the new k and v")
    if any(forward_batch.extend_prefix_lens_cpu):
        raise ValueError("pool_free attention is only valid without a cached prefix")
