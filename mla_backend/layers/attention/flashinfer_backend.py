"""`FlashInferAttnBackend`: attention over the slot pools with flashinfer's JIT-compiled kernels.

Optional (`attention_backend="flashinfer"`): imported only by
`model_runner.create_attention_backend`; raises ImportError naming the package when flashinfer is
missing. Written against flashinfer-python 0.7.2.post1; FA2 kernels only (`backend="fa2"`).

Owns, per step, the page tables flashinfer reads and one planned wrapper per layer geometry:
- MHA/GQA/MQA pool, Dk == Dv: `BatchDecodeWithPagedKVCacheWrapper` (decode),
  `BatchPrefillWithPagedKVCacheWrapper` (extend, causal);
- MHA pool, Dk != Dv (DeepSeek MHA, 192/128): `BatchPrefillWithPagedKVCacheWrapper` for both;
- MLA latent pool (absorbed): `BatchMLAPagedAttentionWrapper` (causal for extend);
- `layer.pool_free` (decompressed MLA prefill): `BatchPrefillWithRaggedKVCacheWrapper` (causal).
Pages are token slots (page_size 1): request i's pages, `req_to_token[req_pool_indices[i],
:seq_lens[i]]`, are gathered on the device into int32 `kv_indices` [sum(seq_lens)]. `plan()` takes
host indptr arrays (from the ForwardBatch's host lists) and runs once per step and geometry. Pools
are passed as views, never copied (MLA latent [S, 1, 576] as flashinfer's packed ckv + kpe cache).
New K/V are stored first (`mla_kernels.store_kv`); causal masks align new tokens with the KV end.
Raises ValueError for FP8 pools and fp32 activations (FA2 takes 16-bit q/KV). No CUDA graphs: the
graph hooks raise NotImplementedError, so `ModelRunner` decodes eagerly (plan() needs host lengths).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

try:
    import flashinfer
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
except ImportError as exc:  # the message names the package; the cause says what failed
    raise ImportError(
        "attention_backend='flashinfer' needs the optional flashinfer-python package "
        f"(written against 0.7.2.post1), which could not be imported: {exc}. Install it or "
        "choose attention_backend='triton'.") from exc

from mla_backend.layers.attention.base import AttentionBackend, check_pool_free
from mla_kernels.store_kv import store_kv

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch
    from mla_backend.layers.radix_attention import RadixAttention

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace (split-KV partials)
_FI_DTYPES = (torch.float16, torch.bfloat16)


def _indptr(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 CPU exclusive prefix sum."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def gather_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      seq_lens: torch.Tensor, kv_indptr: torch.Tensor,
                      total: int) -> torch.Tensor:
    """Concatenated slot lists of a batch, on the device of req_to_token, without host sync.

    Args:
        req_to_token: [rows, max_context] int32 slot table.
        req_pool_indices: [bs] int64 rows of the batch (same device).
        seq_lens: [bs] int64 tokens per request (same device).
        kv_indptr: [bs + 1] int32 prefix sum of seq_lens (same device).
        total: sum(seq_lens), known on the host.
    Returns:
        [total] int32: req_to_token[req_pool_indices[i], :seq_lens[i]] for i in order.
    """
    dev = req_to_token.device
    owner = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=dev), seq_lens,
                                    output_size=total)  # [total] request of each entry
    col = torch.arange(total, device=dev) - kv_indptr[:-1].long()[owner]
    return req_to_token[req_pool_indices[owner], col].to(torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    """Args:
        device: the CUDA device of the pools.
    Raises:
        ValueError: device is not CUDA.
    """

    # Absorbed-MLA decode may store its latent rows itself (mla_rope_store): this backend only
    # reads the pool then (k = None, save_kv_cache=False).
    fused_mla_prologue = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend needs a CUDA device, got {device}")
        self.device = device
        self.flashinfer_version: str = flashinfer.__version__
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, Any] = {}  # geometry key -> wrapper (kept across steps)
        self._planned: set[tuple] = set()  # keys planned for the current step
        # Per-step metadata (init_forward_metadata). *_host: CPU int32, as plan() wants them.
        self._is_decode = False
        self._qo_indptr_host = torch.zeros(1, dtype=torch.int32)  # [bs + 1]
        self._kv_indptr_host = torch.zeros(1, dtype=torch.int32)  # [bs + 1]
        self._kv_lens_host = torch.zeros(0, dtype=torch.int32)  # [bs]
        self._kv_indices: torch.Tensor | None = None  # [sum(seq_lens)] int32, device

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Page tables of the step: host indptrs from the batch's host lists, kv_indices gathered
        on the device. Wrappers are planned lazily, once per geometry, in the first layer call.

        Raises:
            ValueError: an FP8 KV pool (not supported by this backend).
        """
        fb = forward_batch
        if getattr(fb.token_to_kv_pool, "is_fp8", False):
            raise ValueError("the flashinfer backend does not support FP8 KV caches; use "
                             "attention_backend='triton' with kv_cache_dtype fp8_*")
        self._planned.clear()
        self._is_decode = fb.forward_mode.is_decode()
        seq = list(fb.seq_lens_cpu)
        self._qo_indptr_host = _indptr([1] * len(seq) if self._is_decode
                                       else list(fb.extend_seq_lens_cpu))
        self._kv_indptr_host = _indptr(seq)
        self._kv_lens_host = torch.tensor(seq, dtype=torch.int32)
        total = int(self._kv_indptr_host[-1])
        kv_indptr = self._kv_indptr_host.to(self.device, non_blocking=True)
        self._kv_indices = gather_kv_indices(fb.req_to_token_pool.req_to_token,
                                             fb.req_pool_indices, fb.seq_lens, kv_indptr, total)

    # ------------------------------------------------------------------ helpers
    def _wrapper(self, key: tuple, make: Any) -> tuple[Any, bool]:
        """(wrapper for key, whether it still needs plan() this step)."""
        if key not in self._wrappers:
            self._wrappers[key] = make()
        fresh = key not in self._planned
        self._planned.add(key)
        return self._wrappers[key], fresh

    @staticmethod
    def _check_dtypes(q: torch.Tensor, kv: torch.Tensor) -> None:
        if q.dtype not in _FI_DTYPES or kv.dtype not in _FI_DTYPES:
            raise ValueError(f"the flashinfer backend needs fp16/bf16 q and KV, got {q.dtype} "
                             f"and {kv.dtype} (run the model in bfloat16)")

    def _store(self, layer: RadixAttention, fb: ForwardBatch, k: torch.Tensor | None,
               v: torch.Tensor | None, save: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Write new K/V at out_cache_loc when asked; (k_buffer, v_buffer, is latent pool)."""
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        latent = k_buf.untyped_storage().data_ptr() == v_buf.untyped_storage().data_ptr()
        if save and k is not None:
            store_kv(k_buf, None if latent else v_buf, fb.out_cache_loc, k,
                     None if latent else v)
        return k_buf, v_buf, latent

    def _mla(self, q: torch.Tensor, k_buf: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """Absorbed MLA over the latent pool: q [T, H, ckv + kpe] -> [T, H, ckv]."""
        ckv, kpe = layer.v_head_dim, k_buf.shape[-1] - layer.v_head_dim
        key = ("mla", layer.num_heads, ckv, kpe, q.dtype, k_buf.dtype, layer.scaling,
               self._is_decode)
        w, fresh = self._wrapper(key, lambda: BatchMLAPagedAttentionWrapper(
            self._workspace, backend="fa2"))
        if fresh:
            assert self._kv_indices is not None
            w.plan(metadata=MLAPlanMetadata.csr(self._qo_indptr_host, self._kv_indptr_host,
                                                self._kv_indices, self._kv_lens_host),
                   num_heads=layer.num_heads, head_dim_ckv=ckv, head_dim_kpe=kpe, page_size=1,
                   causal=not self._is_decode, sm_scale=layer.scaling, q_data_type=q.dtype,
                   kv_data_type=k_buf.dtype)
        return w.run(query=q, kv_cache=k_buf)  # packed [S, page 1, ckv + kpe] pool buffer

    def _paged(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               layer: RadixAttention) -> torch.Tensor:
        """MHA/GQA/MQA over the K/V pools: q [T, H, Dk] -> [T, H, Dv]."""
        hkv, dk, dv = int(k_buf.shape[1]), int(k_buf.shape[-1]), int(v_buf.shape[-1])
        last_page_len = torch.ones(len(self._kv_lens_host), dtype=torch.int32)
        kv = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [S, page 1, Hkv, D] views
        if self._is_decode and dk == dv:
            key = ("decode", layer.num_heads, hkv, dk, q.dtype, k_buf.dtype, layer.scaling)
            w, fresh = self._wrapper(key, lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=True, backend="fa2"))
            if fresh:
                w.plan(self._kv_indptr_host, self._kv_indices, last_page_len,
                       num_qo_heads=layer.num_heads, num_kv_heads=hkv, head_dim=dk, page_size=1,
                       q_data_type=q.dtype, kv_data_type=k_buf.dtype, sm_scale=layer.scaling)
            return w.run(q, kv)
        key = ("prefill", layer.num_heads, hkv, dk, dv, q.dtype, k_buf.dtype, layer.scaling,
               self._is_decode)
        w, fresh = self._wrapper(key, lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2"))
        if fresh:
            w.plan(self._qo_indptr_host, self._kv_indptr_host, self._kv_indices, last_page_len,
                   layer.num_heads, hkv, dk, 1, head_dim_vo=dv, causal=True,
                   sm_scale=layer.scaling, q_data_type=q.dtype, kv_data_type=k_buf.dtype)
        return w.run(q, kv)

    def _ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: RadixAttention) -> torch.Tensor:
        """Causal attention over each request's new tokens only (pool_free)."""
        hkv, dk, dv = int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1])
        key = ("ragged", layer.num_heads, hkv, dk, dv, q.dtype, layer.scaling)
        w, fresh = self._wrapper(key, lambda: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2"))
        if fresh:
            w.plan(self._qo_indptr_host, self._qo_indptr_host, layer.num_heads, hkv, dk,
                   head_dim_vo=dv, causal=True, sm_scale=layer.scaling, q_data_type=q.dtype,
                   kv_data_type=k.dtype)
        return w.run(q.contiguous(), k.contiguous(), v.contiguous())  # views: dense copies

    def _over_pool(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                   layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        """Store the new K/V (when given and asked), then attend over the pool: the MLA wrapper
        for the latent pool, the paged one otherwise. [T, H, Dv], q's dtype."""
        k_buf, v_buf, latent = self._store(layer, fb, k, v, save_kv_cache)
        self._check_dtypes(q, k_buf)
        return self._mla(q, k_buf, layer) if latent else self._paged(q, k_buf, v_buf, layer)

    # ------------------------------------------------------------------ forward
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_extend`. q [T, H, D] fp16/bf16 -> [T, H * Dv], q's dtype.

        Raises:
            ValueError: pool_free without k/v or with a cached prefix; fp32 q or KV.
        """
        fb = forward_batch
        if layer.pool_free:
            check_pool_free(k, v, fb)
            self._check_dtypes(q, k)
            o = self._ragged(q, k, v, layer)
        else:
            o = self._over_pool(q, k, v, layer, fb, save_kv_cache)
        return o.reshape(q.shape[0], -1)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """See `AttentionBackend.forward_decode`. q [bs, H, D] -> [bs, H * Dv], q's dtype.

        Raises:
            ValueError: fp32 q or KV.
        """
        o = self._over_pool(q, k, v, layer, forward_batch, save_kv_cache)
        return o.reshape(q.shape[0], -1)
