"""`ModelRunner`: owns the model, the KV memory pools and the attention backend of one engine.

Built once by the engine from the frozen `EngineConfig`:
1. picks device (auto: cuda when available) and dtype (auto: fp32 on CPU, bf16 on GPU),
2. reads the HF config (`transformers.AutoConfig`) and builds the model class from
   `models.registry`, directly on the device in the target dtype,
3. loads the safetensors weights (`model_loader`), checks every parameter was filled, and runs
   `post_load_weights()` (e.g. MLA weight absorption),
4. sizes and creates the pools from `model.kv_pool_layout()` and `CacheConfig`:
   `req_to_token_pool` (max_running_requests + 1 rows), `token_to_kv_pool_allocator` and
   `token_to_kv_pool` (MHA or MLA) of `max_total_num_tokens` slots (+ the sink slot 0), stored
   in `kv_cache_dtype` (the model dtype, or FP8 with the checkpoint's KV scales — the model's
   `kv_cache_scales` from `load_weights`; a non-FP8 pool ignores them),
5. creates the attention backend named by `RunnerConfig.attention_backend`,
6. on CUDA, unless `disable_cuda_graph`, captures decode CUDA graphs (`CudaGraphRunner`, with
   torch.compile when `enable_torch_compile`) in the memory left outside the pools.

Memory plan on CUDA (`max_total_tokens` unset): after the weights are loaded, the pools get
`free - total * (1 - mem_fraction_static)` bytes (the rest is for activations and graphs); the
resulting capacity in tokens is logged at start-up and kept in `max_total_num_tokens`.

Per step the engine turns a `ScheduleBatch` into a `ForwardBatch` (`make_forward_batch`) and calls
`forward`, which returns the logits (fp32; from a CUDA graph replay in the model dtype).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from mla_backend.config import EngineConfig
from mla_backend.forward_batch import ForwardBatch, ForwardMode
from mla_backend.host_tensors import int64_tensor
from mla_backend.layers.attention.base import AttentionBackend
from mla_backend.layers.logits import select_logit_rows
from mla_backend.mem_cache.memory_pool import (
    KV_CACHE_DTYPES,
    KVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    is_fp8,
)
from mla_backend.model_executor.cuda_graph_runner import CudaGraphRunner
from mla_backend.model_executor.model_loader import init_dummy_weights, iterate_weights
from mla_backend.model_executor.tp_workers import TpWorkerGroup
from mla_backend.models.registry import get_model_class_for_config

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
CPU_DEFAULT_MAX_RUNNING_REQUESTS = 256
GPU_DEFAULT_MAX_RUNNING_REQUESTS = 1024
# Extra req_to_token columns beyond the longest possible sequence (safety margin, as SGLang).
REQ_TO_TOKEN_MARGIN = 8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """"auto" → cuda when available else cpu; otherwise torch.device(name).

    Raises:
        RuntimeError: a cuda device is asked for but CUDA is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" → fp32 on CPU, bf16 on GPU; else the named dtype."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """KV pool storage dtype for `CacheConfig.kv_cache_dtype`: "auto" → `model_dtype`,
    "fp8_e4m3" → torch.float8_e4m3fn, "fp8_e5m2" → torch.float8_e5m2.

    Raises:
        ValueError: another name.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def kv_cell_bytes(layout: dict, dtype: torch.dtype) -> int:
    """Bytes one token slot takes over all layers for a `kv_pool_layout()` dict, stored in
    `dtype` (the KV cache dtype: 1 byte per value for FP8, 2 for bf16).

    Raises:
        ValueError: unknown layout kind.
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    if layout["kind"] == "mha":
        per_layer = layout["num_kv_heads"] * (layout["head_dim"] + layout["v_head_dim"])
    elif layout["kind"] == "mla":
        per_layer = layout["kv_lora_rank"] + layout["qk_rope_head_dim"]
    else:
        raise ValueError(f"unknown kv pool kind {layout['kind']!r}")
    return per_layer * elem * layout["num_layers"]


def create_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Backend by `RunnerConfig.attention_backend` name; "auto" is triton on CUDA, torch_native
    elsewhere. Each backend module is imported here only when chosen.

    Raises:
        ValueError: unknown name.
        ImportError: the chosen backend's library (triton, flashinfer) is not installed.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch_native"
    if name == "torch_native":
        from mla_backend.layers.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend()
    if name == "triton":
        from mla_backend.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(device)
    if name == "flashinfer":  # optional: flashinfer-python is imported by this module only
        from mla_backend.layers.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(device)
    raise ValueError(f"unknown attention backend {name!r}")


class ModelRunner:
    """See module docstring. Attributes: `config`, `hf_config`, `model`, `device`, `dtype`,
    `kv_cache_dtype`, `vocab_size`, `context_len`, `max_total_num_tokens`, `max_running_requests`,
    `req_to_token_pool`, `token_to_kv_pool`, `token_to_kv_pool_allocator`, `attn_backend`,
    `cuda_graph_runner` (None when decoding eagerly).

    Raises (construction):
        FileNotFoundError: model folder or weights missing.
        UnsupportedModelError: unknown architecture.
        KeyError / ValueError: checkpoint tensors do not match the model.
        RuntimeError: CUDA asked for but missing; not enough memory for the pools.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        mcfg = config.model
        self.device = resolve_device(mcfg.device)
        self.dtype = resolve_dtype(mcfg.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        if not os.path.isdir(mcfg.model_path):  # else transformers reports a bad 'repo id'
            raise FileNotFoundError(f"model_path: model folder {mcfg.model_path!r} does not "
                                    "exist (run `python -m mla_tools.prepare`?)")
        self.hf_config = AutoConfig.from_pretrained(mcfg.model_path)
        self.tp_workers = _start_tp_workers(config)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.tp_rank, self.tp_size = _check_tensor_parallel(config.parallel.tensor_parallel_size)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.model = self._load_model()
        self.context_len = self._derive_context_len()
        self._init_memory_pools()
        self.attn_backend = create_attention_backend(config.runner.attention_backend, self.device)
        self.cuda_graph_runner = self._init_cuda_graphs()
        if self.tp_workers is not None:
            self.tp_workers.wait_ready()

    def close(self) -> None:
        """Stop the tensor-parallel workers this runner started (if any) and leave the process
        group, after freeing this rank's CUDA graphs (they pin the NCCL communicator; see
        `CudaGraphRunner.release`). Idempotent; the runner must not be used afterwards at TP > 1."""
        if getattr(self, "tp_workers", None) is not None:
            if getattr(self, "cuda_graph_runner", None) is not None:
                self.cuda_graph_runner.release()
                self.cuda_graph_runner = None
            self.tp_workers.close()

    # ------------------------------------------------------------------ construction
    def _load_model(self) -> torch.nn.Module:
        cls = get_model_class_for_config(self.hf_config)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.hf_config, self.config.model)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.config.model.load_format == "dummy":
            init_dummy_weights(model, seed=self.config.runner.seed, checkpoint_dtype=self.dtype)
            loaded = None
        else:
            loaded = model.load_weights(iterate_weights(self.config.model.model_path))
        if isinstance(loaded, set):
            missing = sorted(set(dict(model.named_parameters())) - loaded)
            if missing:
                raise ValueError(f"checkpoint lacks weights for: {missing[:10]}"
                                 f"{' ...' if len(missing) > 10 else ''}")
        model.post_load_weights()
        return model.eval()

    def _derive_context_len(self) -> int:
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or 2**31
        want = self.config.model.context_length or max_pos
        if want > max_pos:
            logger.warning("context_length %d > max_position_embeddings %d: using %d",
                           want, max_pos, max_pos)
        ctx = min(want, max_pos)
        window = getattr(self.hf_config, "sliding_window", None)
        uses_window = getattr(self.hf_config, "use_sliding_window", True)
        if window and uses_window and window < ctx:
            # No sliding-window attention here: cap the context so full attention is exact.
            ctx = int(window)
        return ctx

    def _init_memory_pools(self) -> None:
        layout = self.model.kv_pool_layout()
        cell = kv_cell_bytes(layout, self.kv_cache_dtype)
        cache_cfg, sched_cfg = self.config.cache, self.config.scheduler
        total_tokens = cache_cfg.max_total_tokens
        rows = sched_cfg.max_running_requests
        if self.device.type == "cpu":
            total_tokens = total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS
            rows = rows or min(max(total_tokens // 2, 1), CPU_DEFAULT_MAX_RUNNING_REQUESTS)
        else:
            if total_tokens is None:
                torch.cuda.synchronize(self.device)
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - total * (1.0 - cache_cfg.mem_fraction_static)
                guess = int(budget // cell)
                rows = rows or min(max(guess // 2, 1), GPU_DEFAULT_MAX_RUNNING_REQUESTS)
                width = min(self.context_len, max(guess, 1)) + REQ_TO_TOKEN_MARGIN
                total_tokens = int((budget - (rows + 1) * width * 4) // cell)
                if total_tokens < 2:
                    raise RuntimeError(
                        f"not enough GPU memory for the KV cache: {free / 2**30:.2f} GiB free of "
                        f"{total / 2**30:.2f} GiB, mem_fraction_static="
                        f"{cache_cfg.mem_fraction_static}; raise it or set max_total_tokens")
            rows = rows or min(max(total_tokens // 2, 1), GPU_DEFAULT_MAX_RUNNING_REQUESTS)
            if self.tp_size > 1:
                # Every rank mirrors rank 0's slot and row indices: all ranks take the smallest
                # pool any of them can hold (free memory differs a little between GPUs).
                sizes = torch.tensor([total_tokens, rows], dtype=torch.int64, device=self.device)
                torch.distributed.all_reduce(sizes, op=torch.distributed.ReduceOp.MIN)
                total_tokens, rows = (int(v) for v in sizes.tolist())
        self.max_total_num_tokens = int(total_tokens)
        self.max_running_requests = int(rows)
        width = min(self.context_len, self.max_total_num_tokens) + REQ_TO_TOKEN_MARGIN
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, width, self.device)
        if self.tp_workers is not None:  # their tables replay this one's writes (encode_step)
            self.req_to_token_pool.track_writes()
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_num_tokens,
                                                                 self.device)
        self.token_to_kv_pool = self._make_kv_pool(layout)
        logger.info("KV pool: %s, %s, %d slots x %d B, %d request rows, context %d "
                    "(%.2fx the slots of a bf16 cache at equal memory)",
                    layout["kind"], str(self.kv_cache_dtype).replace("torch.", ""),
                    self.max_total_num_tokens, cell, self.max_running_requests, self.context_len,
                    kv_cell_bytes(layout, torch.bfloat16) / cell)

    def _kv_scales(self, num_layers: int) -> tuple[list[float], list[float]] | None:
        """Per-layer (k, v) scales for an FP8 pool from the checkpoint (1.0 where absent);
        None for a non-FP8 pool, which ignores checkpoint scales."""
        found: dict[int, dict[str, float]] = getattr(self.model, "kv_cache_scales", None) or {}
        if not is_fp8(self.kv_cache_dtype):
            if found:
                logger.info("kv_cache_dtype %s: the checkpoint's KV-cache scales (%d layers) are "
                            "not used", self.config.cache.kv_cache_dtype, len(found))
            return None
        logger.info("FP8 KV cache: checkpoint scales for %d of %d layers (1.0 for the rest)",
                    len(found), num_layers)
        return ([found.get(i, {}).get("k", 1.0) for i in range(num_layers)],
                [found.get(i, {}).get("v", 1.0) for i in range(num_layers)])

    def _make_kv_pool(self, layout: dict) -> KVPool:
        n, dtype = layout["num_layers"], self.kv_cache_dtype
        scales = self._kv_scales(n)
        if layout["kind"] == "mha":
            k_scales, v_scales = scales if scales is not None else (None, None)
            return MHATokenToKVPool(self.max_total_num_tokens, dtype, layout["num_kv_heads"],
                                    layout["head_dim"], layout["v_head_dim"], n, self.device,
                                    k_scales=k_scales, v_scales=v_scales)
        if layout["kind"] == "mla":
            # One scale per latent row: the key's (vLLM's MLA convention); v_scale is unused.
            return MLATokenToKVPool(self.max_total_num_tokens, dtype, layout["kv_lora_rank"],
                                    layout["qk_rope_head_dim"], n, self.device,
                                    kv_scales=None if scales is None else scales[0])
        raise ValueError(f"unknown kv pool kind {layout['kind']!r}")

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        rcfg = self.config.runner
        if self.device.type != "cuda" or rcfg.disable_cuda_graph:
            return None
        if type(self.attn_backend).init_cuda_graph_state is AttentionBackend.init_cuda_graph_state:
            logger.info("attention backend %s has no CUDA graph support: decoding eagerly",
                        type(self.attn_backend).__name__)
            return None
        return CudaGraphRunner(self)

    # ------------------------------------------------------------------ per step
    def make_forward_batch(
        self,
        mode: ForwardMode,
        input_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        req_pool_indices: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int] | torch.Tensor | None,
        extend_lens: Sequence[int] | torch.Tensor | None,
        out_cache_loc: Sequence[int] | torch.Tensor,
        return_all_logits: bool = False,
    ) -> ForwardBatch:
        """Build a `ForwardBatch` from host lists / CPU tensors (copied to the device).

        Args:
            mode: EXTEND or DECODE.
            input_ids, positions, out_cache_loc: [T] per new token, requests in batch order.
            req_pool_indices, seq_lens: [bs] (seq_len = prefix + new tokens).
            prefix_lens, extend_lens: [bs]; for DECODE may be None (= seq_len - 1 and 1).
            return_all_logits: logits for every new token instead of each request's last.
        NOTE: `req_to_token[req_pool_indices[i], prefix_lens[i]:seq_lens[i]]` must already hold
        this request's `out_cache_loc` segment (the scheduler writes it).
        Raises:
            ValueError: inconsistent lengths.
        """
        # Lists as given (Python ints from the scheduler, `tolist()` of tensors): no
        # per-element conversion (per-request Python bounds large decode steps: issue 6).
        seq = _as_list(seq_lens)
        derived = False  # decode lengths made here from seq: consistent by construction
        if mode.is_decode():
            derived = prefix_lens is None and extend_lens is None
            prefix = [s - 1 for s in seq] if prefix_lens is None else _as_list(prefix_lens)
            ext = [1] * len(seq) if extend_lens is None else _as_list(extend_lens)
        else:
            if prefix_lens is None or extend_lens is None:
                raise ValueError("EXTEND needs prefix_lens and extend_lens")
            prefix, ext = _as_list(prefix_lens), _as_list(extend_lens)
        ids, pos, out_loc = _as_list(input_ids), _as_list(positions), _as_list(out_cache_loc)
        rows = _as_list(req_pool_indices)
        num_tokens = len(ids)
        if not (len(prefix) == len(ext) == len(seq) == len(rows)):
            raise ValueError(
                "req_pool_indices, seq_lens, prefix_lens, extend_lens differ in length")
        if derived:  # (one token per row)
            consistent = len(seq) == num_tokens
        else:
            consistent = (all(p + e == s for p, e, s in zip(prefix, ext, seq))
                          and sum(ext) == num_tokens)
        if not consistent:
            raise ValueError(f"inconsistent lengths: prefix {prefix} + extend {ext} vs seq {seq}, "
                             f"{num_tokens} tokens")
        if len(out_loc) != num_tokens or len(pos) != num_tokens:
            raise ValueError("positions / out_cache_loc must have one entry per input token")
        # One host-to-device copy for all five index tensors (each a contiguous slice of it):
        # separate small copies cost a few microseconds of host time each, every step.
        host = int64_tensor(ids + pos + out_loc + rows + seq)
        packed = host.to(self.device, non_blocking=True)  # no wait: see host_tensors.int64_on
        t, b = num_tokens, len(seq)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=b,
            input_ids=packed[:t],
            positions=packed[t:2 * t],
            out_cache_loc=packed[2 * t:3 * t],
            req_pool_indices=packed[3 * t:3 * t + b],
            seq_lens=packed[3 * t + b:],
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            return_all_logits=return_all_logits,
            host_packed=host,
        )

    def check_workers(self) -> None:
        """Between steps: notice a tensor-parallel worker that died while idle (a no-op at TP 1
        and when the caller runs the other ranks itself).

        Raises:
            TpWorkerError: a worker exited or an earlier step failed (see `TpWorkerGroup`).
        """
        if self.tp_workers is not None:
            self.tp_workers.check_alive()

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run the model: logits [bs, V] (or [T, V] with `return_all_logits`): fp32 from an
        eager forward. Decode batches of up to `cuda_graph_runner.max_bs` rows replay a CUDA
        graph instead; their logits are in the model dtype (an eager run's fp32 logits are
        those values converted), a view of the graphs' static buffer valid until the next
        replay (`CudaGraphRunner.replay`): queue whatever reads them before the next forward.

        Raises:
            TpWorkerError: with workers (TP > 1 started here), a worker is dead or this step
                failed after they were sent it (fatal: the ranks are out of step).
        """
        if self.tp_workers is None:
            return self._forward(forward_batch)
        self.tp_workers.send_step(forward_batch)  # workers run the same step
        try:
            return self._forward(forward_batch)
        except Exception as e:  # noqa: BLE001 - e.g. gloo's "connection reset" from a dead rank
            raise self.tp_workers.step_failed(e) from e

    def _forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            cgr = self.cuda_graph_runner
            if cgr is not None and cgr.can_run(forward_batch):
                return cgr.replay(forward_batch)
            self.attn_backend.init_forward_metadata(forward_batch)
            hidden = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            hidden = select_logit_rows(hidden, forward_batch)
            return self.model.compute_logits(hidden).float()


def _start_tp_workers(config: EngineConfig) -> TpWorkerGroup | None:
    """TP > 1 with no process group yet (e.g. inside the Triton adapter): spawn ranks 1..N-1 and
    join the group as rank 0. None at TP 1 or when the caller runs the ranks itself."""
    want = config.parallel.tensor_parallel_size
    from mla_backend.distributed import is_tensor_parallel_initialized

    if want <= 1 or is_tensor_parallel_initialized():
        return None
    return TpWorkerGroup(config, want, ModelRunner)


def _check_tensor_parallel(want: int) -> tuple[int, int]:
    """(rank, size) of the initialized tensor-parallel group, checked against the config.

    Raises:
        RuntimeError: the config asks for a TP degree the process group does not have.
    """
    from mla_backend.distributed import get_tp_rank, get_tp_size

    have = get_tp_size()
    if have != want:
        raise RuntimeError(
            f"tensor_parallel_size={want}, but this process is in a tensor-parallel group of "
            f"{have}: either build the engine with no process group (rank 0 then starts the "
            f"other ranks) or call mla_backend.distributed.init_tensor_parallel(rank, {want}, "
            "...) in every rank first")
    return get_tp_rank(), have


def _as_list(x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return list(x)
