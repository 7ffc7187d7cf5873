"""`CudaGraphRunner`: decode steps replayed from CUDA graphs, optionally torch.compile'd.

Owned by `ModelRunner` (CUDA device, a backend that supports graphs, `disable_cuda_graph` off).
Captures one graph per batch-size bucket (1, 2, 4, 8, then steps of 8 up to `cuda_graph_max_bs`,
capped at the pool's request rows), largest first, sharing one memory pool, over static [max_bs]
int64 buffers `input_ids`, `positions`, `req_pool_indices`, `seq_lens`, `out_cache_loc`. A graph
runs embedding → layers → final norm → LM head into rows [:bs] of one static [max_bs, vocab]
logits buffer (model dtype) shared by all buckets; sampling stays outside.

`replay`: copies the live batch in, pads rows up to the bucket (request row 0, seq_len 1, sink
slot 0), recomputes the backend's metadata outside the graph, replays, and returns the first
raw_bs logit rows as a view of the static buffer: valid only until the next replay, so readers
(the sampler) must queue their work before it.

With `enable_torch_compile`, buckets <= `torch_compile_max_bs` capture a
`torch.compile(mode=torch_compile_mode, dynamic=False)` forward; while compiling, layers use
their `forward_native` forms (`torch.compiler.is_compiling()`), attention stays opaque.
Graph-mode decode must not read host-side batch data: the captured ForwardBatch carries
placeholder host lists (seq_len 1 per row) that are never updated.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from mla_backend.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from mla_backend.config import EngineConfig
    from mla_backend.layers.attention.base import AttentionBackend
    from mla_backend.mem_cache.memory_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# Request row and KV slot that padded graph rows use. Row 0 may belong to a live request: padded
# rows only read its first slot (harmless) and write to the sink slot 0, which is never handed out.
PAD_REQ_POOL_INDEX = 0
PAD_SEQ_LEN = 1
PAD_OUT_CACHE_LOC = 0


def batch_size_buckets(max_bs: int) -> list[int]:
    """Capture sizes: 1, 2, 4, 8, then 16, 24, ... below max_bs, and max_bs itself (ascending).

    Raises:
        ValueError: max_bs < 1.
    """
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs]
    sizes += list(range(16, max_bs, 8))
    return sizes + [max_bs]


def compile_counters() -> dict[str, int]:
    """Dynamo's counts so far in this process: {"unique_graphs", "calls_captured"} (for tests that
    check no recompilation happens after capture)."""
    from torch._dynamo.utils import counters

    stats = counters["stats"]
    return {"unique_graphs": int(stats.get("unique_graphs", 0)),
            "calls_captured": int(stats.get("calls_captured", 0))}


class GraphOwner(Protocol):
    """What a `CudaGraphRunner` reads of its owner, the `ModelRunner` (which imports this module,
    so it is named by its parts here)."""

    config: "EngineConfig"
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_running_requests: int
    model: Any  # the model (`forward`, `compute_logits`)
    attn_backend: "AttentionBackend"
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "KVPool"


class CudaGraphRunner:
    """Args:
        model_runner: a `ModelRunner` on CUDA whose pools and attention backend exist.
    Attributes: `max_bs`, `capture_bs` (ascending), `compile_bs`, `capture_seconds`,
        `compile_seconds` (time of the compiled warm-up runs), `graph_memory_bytes` (device memory
        the capture took, from `torch.cuda.mem_get_info` before/after).
    Raises:
        RuntimeError: not on CUDA, or the backend does not support CUDA graphs.
    """

    def __init__(self, model_runner: GraphOwner) -> None:
        mr = model_runner
        if mr.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        rcfg = mr.config.runner
        self.model_runner = mr
        self.device = mr.device
        self.max_bs = max(1, min(rcfg.cuda_graph_max_bs, mr.max_running_requests))
        self.capture_bs = batch_size_buckets(self.max_bs)
        self.compile_bs = ([b for b in self.capture_bs if b <= rcfg.torch_compile_max_bs]
                           if rcfg.enable_torch_compile else [])
        mr.attn_backend.init_cuda_graph_state(self.max_bs)  # NotImplementedError if unsupported

        def zeros(fill: int = 0) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=self.device)

        self.input_ids = zeros()
        self.positions = zeros()
        self.req_pool_indices = zeros(PAD_REQ_POOL_INDEX)
        self.seq_lens = zeros(PAD_SEQ_LEN)
        self.out_cache_loc = zeros(PAD_OUT_CACHE_LOC)
        # One static logits buffer for all buckets (graphs write rows [:bs]); per-bucket
        # outputs would keep sum(buckets) x vocab values alive. In the model dtype: the lm_head
        # GEMM writes it directly (fp32 would cost a conversion pass per step), and the greedy
        # sampler reads 16-bit logits as they are.
        self.logits = torch.zeros(self.max_bs, mr.vocab_size, dtype=mr.dtype,
                                  device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.compiled_forward: Callable | None = None
        self.capture_seconds = 0.0
        self.compile_seconds = 0.0
        self.graph_memory_bytes = 0
        if self.compile_bs:
            self.compiled_forward = _compile(mr.model.forward, rcfg.torch_compile_mode)
        self.capture()

    # ------------------------------------------------------------------ capture
    def _static_batch(self, bs: int) -> ForwardBatch:
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[PAD_SEQ_LEN] * bs,
            extend_prefix_lens_cpu=[PAD_SEQ_LEN - 1] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=mr.attn_backend,
        )

    def _run_once(self, bs: int, fb: ForwardBatch) -> None:
        mr = self.model_runner
        forward = self.compiled_forward if bs in self.compile_bs else mr.model.forward
        hidden = forward(fb.input_ids, fb.positions, fb)
        mr.model.compute_logits(hidden, out=self.logits[:bs])

    def capture(self) -> None:
        """Capture every bucket (largest first, one shared memory pool). Warm-up runs (and
        compilation) happen before each capture on the capture stream."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.device)
        backend = self.model_runner.attn_backend
        with torch.inference_mode():
            for bs in reversed(self.capture_bs):
                fb = self._static_batch(bs)
                backend.init_forward_metadata_capture_cuda_graph(bs, fb)
                tc = time.perf_counter()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._run_once(bs, fb)
                stream.synchronize()
                if bs in self.compile_bs:
                    self.compile_seconds += time.perf_counter() - tc
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run_once(bs, fb)
                if pool is None:
                    pool = graph.pool()
                self.graphs[bs], self.batches[bs] = graph, fb
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("CUDA graphs: %d buckets up to bs %d in %.1f s (compile %.1f s for bs <= %s), "
                    "%.0f MiB", len(self.capture_bs), self.max_bs, self.capture_seconds,
                    self.compile_seconds, max(self.compile_bs, default="-"),
                    self.graph_memory_bytes / 2**20)

    def release(self) -> None:
        """Free every captured graph (`CUDAGraph.reset`) and its static batch; `can_run` is
        False afterwards. Needed before a NCCL process group is destroyed: each graph that
        captured a collective holds a reference on the communicator, and `ncclCommDestroy` waits
        for those references (it hangs while the graphs live; PyTorch issue 115388)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.batches.clear()

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True for decode batches of at most `max_bs` rows that want one logit row each."""
        return (forward_batch.forward_mode.is_decode()
                and 1 <= forward_batch.batch_size <= self.max_bs
                and not forward_batch.return_all_logits)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run a decode batch through its bucket's graph.

        Args:
            forward_batch: a DECODE batch with `can_run(forward_batch)`; its device tensors are
                copied into the static buffers.
        Returns:
            logits [raw_bs, vocab] in the model dtype (the lm_head's output, unconverted): rows
            of the graphs' static output buffer, valid until the next replay. Work that reads
            them must be queued (on this stream) before then, as `Sampler.launch` does; a copy
            of 1,024 x 102,400 values would cost ~0.1-0.2 ms per step.
        """
        raw = forward_batch.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]
        if bs != raw:
            self.input_ids[raw:bs].zero_()
            self.positions[raw:bs].zero_()
            self.req_pool_indices[raw:bs].fill_(PAD_REQ_POOL_INDEX)
            self.seq_lens[raw:bs].fill_(PAD_SEQ_LEN)
            self.out_cache_loc[raw:bs].fill_(PAD_OUT_CACHE_LOC)
        self.input_ids[:raw].copy_(forward_batch.input_ids)
        self.positions[:raw].copy_(forward_batch.positions)
        self.req_pool_indices[:raw].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw].copy_(forward_batch.seq_lens)
        self.out_cache_loc[:raw].copy_(forward_batch.out_cache_loc)
        fb = self.batches[bs]
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(bs, fb)
        self.graphs[bs].replay()
        return self.logits[:raw]


def _compile(fn: Callable, mode: str) -> Callable:
    """torch.compile as the seed (default mode "max-autotune-no-cudagraphs": autotuned GEMMs,
    no inductor CUDA graphs of its own), static shapes (one compilation per bucket), caches
    large enough for every bucket."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 4096)
    inductor_config.coordinate_descent_tuning = True
    inductor_config.fx_graph_cache = True
    return torch.compile(fn, mode=mode, dynamic=False)


__all__ = ["CudaGraphRunner", "batch_size_buckets", "compile_counters"]
