"""`TorchNativeAttnBackend`: the obviously-correct reference attention over the slot pools.

The oracle for every other backend, on CPU and GPU. Per layer and per request it:
1. writes the new tokens' K/V into the KV pool at `forward_batch.out_cache_loc` (save_kv_cache),
2. gathers all of the request's K/V through `req_to_token[req_pool_idx, :seq_len]`,
3. runs causal attention in fp32: new token j (position prefix_len + j) sees positions <= its own.

Handles GQA/MQA (KV heads repeated), v_head_dim != head_dim (MLA absorbed: head_dim 576, value =
the pool's 512-column view; DeepSeek MHA pool: 192 / 128), and `layer.pool_free` (MLA decompressed
prefill: attention over the given new k/v of each request only, no pool access).
FP8 pools: K/V are read through `pool.gather_kv` (dequantized to fp32: stored * scale); the new
tokens are attended from the pool too, so they see their own quantization like the prefix does.
Extend loops over requests on the host; decode is batched over requests with a padded slot
table and a length mask. Clear rather than fast: never the speed path on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mla_backend.layers.attention.base import AttentionBackend, check_pool_free
from mla_kernels.reference import attention_ref

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch
    from mla_backend.layers.radix_attention import RadixAttention


class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend. Stateless across steps except the per-step slot lists."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []  # per request: [seq_len] int64 slot ids, device
        # DECODE only: padded slot table [bs, max_seq_len] int64 and its validity mask (bool).
        self._decode_slots: torch.Tensor | None = None
        self._decode_valid: torch.Tensor | None = None

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
        self._decode_slots = self._decode_valid = None
        if forward_batch.forward_mode.is_decode():
            max_len = max(forward_batch.seq_lens_cpu)
            self._decode_slots = table[forward_batch.req_pool_indices, :max_len].long()
            positions = torch.arange(max_len, device=table.device)
            self._decode_valid = positions[None, :] < forward_batch.seq_lens[:, None]

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
            check_pool_free(k, v, fb)
            for start, n in zip(starts, fb.extend_seq_lens_cpu):
                sl = slice(start, start + n)
                out[sl] = attention_ref(q[sl], k[sl], v[sl], layer.scaling, 0).to(q.dtype)
            return out.reshape(q.shape[0], -1)
        pool = fb.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        for i, (start, n) in enumerate(zip(starts, fb.extend_seq_lens_cpu)):
            slots = self._slots[i]
            prefix_len = fb.extend_prefix_lens_cpu[i]
            if slots.shape[0] != prefix_len + n:
                raise ValueError(f"request {i}: seq_len {slots.shape[0]} != prefix {prefix_len}"
                                 f" + new {n}")
            sl = slice(start, start + n)
            keys, values = pool.gather_kv(layer.layer_id, slots)
            o = attention_ref(q[sl], keys, values, layer.scaling, prefix_len)
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
            ValueError: seq_len != prefix + new tokens for a request; pool_free without k/v
                or with a cached prefix.
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
        """See `AttentionBackend.forward_decode`: one query per request over its whole sequence,
        batched over requests with a padded slot table and a length mask (fp32 math).

        Returns:
            [bs, H * v_head_dim], dtype of q.
        """
        if layer.pool_free or self._decode_slots is None or self._decode_valid is None:
            return self._forward(q, k, v, layer, forward_batch, save_kv_cache)
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        bs, n_heads, _ = q.shape
        keys, values = pool.gather_kv(layer.layer_id, self._decode_slots)
        keys, values = keys.float(), values.float()  # [bs, L, KV, D], [bs, L, KV, Dv]
        kv_heads = keys.shape[2]
        qg = q.float().reshape(bs, kv_heads, n_heads // kv_heads, -1)  # [bs, KV, G, D]
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * layer.scaling
        scores = scores.masked_fill(~self._decode_valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values)  # [bs, KV, G, Dv]
        return out.reshape(bs, n_heads * layer.v_head_dim).to(q.dtype)
