"""`TorchNativeAttnBackend`: the obviously-correct reference attention over the slot pools.

The oracle for every other backend, on CPU and GPU. Per layer and per request it:
1. writes the new tokens' K/V into the KV pool at `forward_batch.out_cache_loc` (save_kv_cache),
2. gathers all of the request's K/V through `req_to_token[req_pool_idx, :seq_len]`,
3. runs causal attention in fp32: new token j (position prefix_len + j) sees positions <= its own.

Handles GQA/MQA (KV heads repeated), v_head_dim != head_dim (MLA absorbed: head_dim 576, value =
the pool's 512-column view; DeepSeek MHA pool: 192 / 128), and `layer.pool_free` (MLA decompressed
prefill: attention over the given new k/v of each request only, no pool access).
Host loops over requests: slow by design, never used for speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mla_backend.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from mla_backend.layers.radix_attention import RadixAttention
    from mla_backend.model_executor.forward_batch import ForwardBatch


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, prefix_len: int
) -> torch.Tensor:
    """Attention of n queries over S = prefix_len + n keys, causal on the new part; fp32 math.

    Args:
        q: [n, H, D]; k: [S, KV, D]; v: [S, KV, Dv] with H % KV == 0 (query head h uses KV head
           h // (H // KV)).
        scaling: softmax scale.
        prefix_len: keys before the first query's own position (query j sees keys <= prefix_len+j).
    Returns:
        [n, H, Dv] fp32.
    Raises:
        ValueError: inconsistent shapes.
    """
    n, h, _ = q.shape
    s, kvh, _ = k.shape
    if s != prefix_len + n or h % kvh or v.shape[0] != s:
        raise ValueError(f"bad attention shapes q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)} prefix_len={prefix_len}")
    group = h // kvh
    kf = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
    vf = v.float().repeat_interleave(group, dim=1)  # [S, H, Dv]
    scores = torch.einsum("nhd,shd->hns", q.float(), kf) * scaling  # [H, n, S]
    q_pos = torch.arange(n, device=q.device).unsqueeze(1) + prefix_len  # [n, 1]
    k_pos = torch.arange(s, device=q.device).unsqueeze(0)  # [1, S]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hns,shd->nhd", probs, vf)


class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend. Stateless across steps except the per-step slot lists."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []  # per request: [seq_len] int64 slot ids, device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Read each request's slot ids once per step (shared by all layers).

        NOTE: the rows of req_to_token must already hold the new tokens' slots (out_cache_loc)
        at positions prefix_len .. seq_len-1 when the forward starts.
        """
        table = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        self._slots = [
            table[row, :seq_len].long() for row, seq_len in zip(rows, forward_batch.seq_lens_cpu)
        ]
        # The oracle double-checks the contract: new tokens' rows point at out_cache_loc.
        new_slots = [s[p:] for s, p in zip(self._slots, forward_batch.extend_prefix_lens_cpu)]
        if new_slots and not torch.equal(torch.cat(new_slots), forward_batch.out_cache_loc):
            raise ValueError("req_to_token rows do not hold out_cache_loc for the new tokens")

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim,
                          dtype=q.dtype, device=q.device)
        starts = fb.extend_start_loc_cpu
        if layer.pool_free:
            if k is None or v is None:
                raise ValueError("pool_free attention needs the new k and v")
            for start, n in zip(starts, fb.extend_seq_lens_cpu):
                sl = slice(start, start + n)
                out[sl] = causal_attention(q[sl], k[sl], v[sl], layer.scaling, 0).to(q.dtype)
            return out.reshape(q.shape[0], -1)
        pool = fb.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        for i, (start, n) in enumerate(zip(starts, fb.extend_seq_lens_cpu)):
            slots = self._slots[i]
            prefix_len = fb.extend_prefix_lens_cpu[i]
            if slots.shape[0] != prefix_len + n:
                raise ValueError(f"request {i}: seq_len {slots.shape[0]} != prefix {prefix_len}"
                                 f" + new {n}")
            sl = slice(start, start + n)
            o = causal_attention(q[sl], k_buf[slots], v_buf[slots], layer.scaling, prefix_len)
            out[sl] = o.to(q.dtype)
        return out.reshape(q.shape[0], -1)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_extend`. Returns [T, H * v_head_dim], dtype of q.

        Raises:
            ValueError: seq_len != prefix + new tokens for a request; pool_free without k/v.
        """
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_decode` (an extend of one token per request)."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)
