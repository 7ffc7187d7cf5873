"""`TritonAttnBackend`: attention over the slot pools with our triton-language kernels.

The GPU default (`attention_backend="triton"`, or `"auto"` on CUDA). Per step,
`init_forward_metadata` turns the `ForwardBatch` into device tensors the kernels read (no host
synchronisation for decode: the KV split plan is computed on the device); per layer,
`forward_extend` / `forward_decode` store the new K/V (`mla_kernels.store_kv`) and run
`mla_kernels.extend_attention` / `mla_kernels.decode_attention` through `req_to_token`.

Layouts follow the pool: MHA/GQA/MQA (`k_buffer` [S, Hkv, Dk], `v_buffer` [S, Hkv, Dv]) and the MLA
latent pool (one [S, 1, kv_lora_rank + qk_rope_head_dim] buffer whose first kv_lora_rank columns
are the value view; `set`-side the key row is the only thing written). `layer.pool_free` layers
(MLA decompressed prefill) attend over the given new K/V only.

FP8 pools (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2): on CUDA the new K/V are written by
`store_kv`'s quantizing store (x · (1 / scale), saturated, round to nearest even: the bytes the
pool's torch write gives, in one launch instead of its five, which matters most to an eager
prefill's host); elsewhere by the pool's `set_kv_buffer` (torch, scattered as bytes: the triton
interpreter's float→fp8 rounding is wrong for values that round up to the next power of two).
The attention kernels read the fp8 pool directly with the layer's `k_scale` / `v_scale`
(dequantization folded into the softmax scale and the P·V product).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mla_backend.layers.attention.base import AttentionBackend, check_pool_free
from mla_kernels.decode_attention import (
    decode_attention_fwd,
    get_num_kv_splits,
    splits_per_request,
)
from mla_kernels.extend_attention import extend_attention_fwd
from mla_kernels.store_kv import store_kv

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch
    from mla_backend.layers.radix_attention import RadixAttention

# Most KV splits per request. The workspace is sized per step from the batch size alone (no data
# dependence): splits beyond `splits_per_request(bs, head groups, SMs, head dim)` are never planned.
DEFAULT_MAX_KV_SPLITS = 64


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class TritonAttnBackend(AttentionBackend):
    """Args:
        device: where the pools live.
        max_kv_splits: most KV splits one decoding request is cut into (flash-decoding).
    """

    fused_mla_prologue = True  # see AttentionBackend

    def __init__(self, device: torch.device, max_kv_splits: int = DEFAULT_MAX_KV_SPLITS) -> None:
        self.device = device
        self.max_kv_splits = max_kv_splits
        self.sm_count = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 8
        )
        # Per-step metadata (filled by init_forward_metadata).
        self._num_kv_splits: dict[int, torch.Tensor] = {}  # head groups → [bs] int32, device
        self._prefix_lens: torch.Tensor | None = None  # [bs] int64, device (extend)
        self._extend_lens: torch.Tensor | None = None  # [bs] int64, device (extend)
        self._extend_start_loc: torch.Tensor | None = None  # [bs] int64, device (extend)
        self._max_extend_len = 0
        # CUDA graphs: static [max_bs] int32 split plan, filled outside the graph before replay.
        self._graph_splits: torch.Tensor | None = None

    # ------------------------------------------------------------------ CUDA graphs
    @staticmethod
    def _pool_split_inputs(forward_batch: "ForwardBatch") -> tuple[int, int, torch.dtype]:
        """(KV heads of the pool (1 for the MLA latent pool): the decode programs per request,
        the pool's QK head dim, its dtype) — what the decode split plan depends on."""
        k_buf, _ = forward_batch.token_to_kv_pool.get_kv_buffer(0)
        return max(1, int(k_buf.shape[1])), int(k_buf.shape[-1]), k_buf.dtype

    def _split_cap(self, bs: int, groups: int, head_dim: int, kv_dtype: torch.dtype) -> int:
        return max(1, min(self.max_kv_splits,
                          splits_per_request(bs, groups, self.sm_count, head_dim, kv_dtype)))

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static split-plan buffer for graphs of up to `max_bs` requests."""
        self._graph_splits = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int,
                                                 forward_batch: "ForwardBatch") -> None:
        """Before capturing decode for `bs` rows: point the plan at the static buffer (the
        captured kernels read `_graph_splits[:bs]`) and fill it for the capture-time lengths.

        Raises:
            RuntimeError: `init_cuda_graph_state` was not called or bs exceeds its max_bs.
        """
        if self._graph_splits is None or bs > self._graph_splits.shape[0]:
            raise RuntimeError("init_cuda_graph_state(max_bs) must cover the captured batch size")
        self.init_forward_metadata_replay_cuda_graph(bs, forward_batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int,
                                                forward_batch: "ForwardBatch") -> None:
        """Before a replay: recompute the split plan of the (padded) `forward_batch.seq_lens`
        [bs] into the static buffer, on the device (no host synchronisation)."""
        assert self._graph_splits is not None
        groups, head_dim, kv_dtype = self._pool_split_inputs(forward_batch)
        out = self._graph_splits[:bs]
        get_num_kv_splits(forward_batch.seq_lens[:bs], groups,
                          self._split_cap(bs, groups, head_dim, kv_dtype), self.sm_count,
                          out=out, head_dim=head_dim, kv_dtype=kv_dtype)
        self._num_kv_splits = {groups: out}

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Plan one step. Extend: per-request lengths and offsets as device tensors (host lists
        are already known). Decode: nothing on the host; split plans are made per head-group
        count on first use in the step (device computation only)."""
        self._num_kv_splits = {}
        if forward_batch.forward_mode.is_decode():
            return
        fb = forward_batch

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        self._prefix_lens = dev(fb.extend_prefix_lens_cpu)
        self._extend_lens = dev(fb.extend_seq_lens_cpu)
        self._extend_start_loc = dev(fb.extend_start_loc_cpu)
        self._max_extend_len = max(fb.extend_seq_lens_cpu, default=0)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _store(layer: "RadixAttention", fb: "ForwardBatch", k: torch.Tensor,
               v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V at out_cache_loc; return the layer's (k_buffer, v_buffer)."""
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        scales = (1.0, 1.0)
        if getattr(pool, "is_fp8", False):  # quantizing write (see module docstring)
            if not k_buf.is_cuda:
                pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
                return k_buf, v_buf
            scales = pool.get_kv_scales(layer.layer_id)
        latent = _shares_storage(k_buf, v_buf)  # MLA: the value is a view of the key row
        store_kv(k_buf, None if latent else v_buf, fb.out_cache_loc, k,
                 None if latent else v, *scales)
        return k_buf, v_buf

    @staticmethod
    def _scales(layer: "RadixAttention", fb: "ForwardBatch") -> tuple[float, float]:
        """(k_scale, v_scale) of the layer's pool buffers (1.0, 1.0 unless FP8)."""
        pool = fb.token_to_kv_pool
        if not getattr(pool, "is_fp8", False):
            return 1.0, 1.0
        return pool.get_kv_scales(layer.layer_id)

    @staticmethod
    def _value_of(k: torch.Tensor, v: torch.Tensor | None, layer: "RadixAttention") -> torch.Tensor:
        """New values; for the latent layout without explicit v: the first v_head_dim columns
        of k (a view)."""
        return v if v is not None else k[..., : layer.v_head_dim]

    # ------------------------------------------------------------------ forward
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_extend`. Returns [T, H * v_head_dim], dtype of q.

        Raises:
            ValueError: k is None (the new tokens' keys are needed), or a pool_free layer
                without v or with a cached prefix.
        """
        fb = forward_batch
        if k is None:
            raise ValueError("the triton backend needs the new tokens' k for extend")
        v_new = self._value_of(k, v, layer)
        o = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype,
                        device=q.device)
        assert self._prefix_lens is not None and self._extend_lens is not None
        assert self._extend_start_loc is not None
        if layer.pool_free:
            check_pool_free(k, v, fb)
            k_buf = v_buf = None
        elif save_kv_cache:
            k_buf, v_buf = self._store(layer, fb, k, v)
        else:
            k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        extend_attention_fwd(
            q, k, v_new, o, k_buf, v_buf,
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
            self._prefix_lens, self._extend_lens, self._extend_start_loc,
            self._max_extend_len, layer.scaling, *self._scales(layer, fb),
        )
        return o.reshape(q.shape[0], -1)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_decode`. Returns [bs, H * v_head_dim], dtype of q."""
        fb = forward_batch
        if save_kv_cache and k is not None:
            k_buf, v_buf = self._store(layer, fb, k, v)
        else:
            k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        bs = q.shape[0]
        groups = max(1, k_buf.shape[1])  # programs per request: one per KV head
        head_dim = int(k_buf.shape[-1])
        cap = self._split_cap(bs, groups, head_dim, k_buf.dtype)
        splits = self._num_kv_splits.get(groups)
        if splits is None:
            splits = get_num_kv_splits(fb.seq_lens, groups, cap, self.sm_count,
                                       head_dim=head_dim, kv_dtype=k_buf.dtype)
            self._num_kv_splits[groups] = splits
        o = torch.empty(bs, layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
        logits = torch.empty(bs, layer.num_heads, cap, layer.v_head_dim,
                             dtype=torch.float32, device=q.device)
        lse = torch.empty(bs, layer.num_heads, cap, dtype=torch.float32, device=q.device)
        decode_attention_fwd(
            q, k_buf, v_buf, o, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
            fb.seq_lens, splits, cap, logits, lse, layer.scaling, *self._scales(layer, fb),
        )
        return o.reshape(bs, -1)
