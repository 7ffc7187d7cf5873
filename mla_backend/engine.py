"""`Engine`: the one place that knows both the scheduler side and the model side.

Owns the request lifecycle. Requests come in through `add_request` / `abort` (thread-safe: they go
through an inbox), one thread calls `step()`, which drains the inbox, asks the `Scheduler` for a
batch, runs it on the `ModelRunner`, samples with the `Sampler`, applies the stop rules of token
ids (EOS, stop token ids, max_tokens, context), hands the batch back to the scheduler and returns
`RequestOutput`s of token ids. Text, stop strings and logprob text are the consumer's
(`tokenizer.output_processor.OutputProcessor`): `generate` / `stream` here, the engine's front door
(`client.EngineClient`) for servers, which runs this engine's loop (`serve_engine`) in a process or
thread of its own. With `overlap_schedule` (on by default on CUDA) a step's outputs are made on
the host while the GPU computes the next step (as SGLang's overlap scheduler hides host work), so
outputs leave one step later. Structured outputs: grammars compile and masks fill in the
`GrammarManager`; jump-forward appends the tokens a grammar forces (the only ones its mask
allows) without a decode step each (`_jump_forward`; the scheduler computes them in one EXTEND).

A failed forward fails its batch's requests and the engine goes on, except a tensor-parallel
failure (`TpWorkerError`: a worker died, the ranks are out of step): then `failed` holds the
message, every live request ends with it, the engine runs no more forwards and `add_request`
raises `EngineFailedError` (the model must be reloaded).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

import torch

from mla_backend.config import GC_THRESHOLDS, EngineConfig
from mla_backend.constrained.manager import GrammarManager, PendingMasks
from mla_backend.forward_batch import ForwardMode
from mla_backend.host_tensors import int64_on
from mla_backend.mem_cache.chunk_cache import ChunkCache
from mla_backend.mem_cache.radix_cache import RadixCache
from mla_backend.model_executor.model_runner import ModelRunner
from mla_backend.model_executor.sampler import LaunchedSample, Sampler, TokenMasks
from mla_backend.model_executor.tp_workers import TpWorkerError
from mla_backend.request import (
    EngineFailedError,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    Req,
    RequestOutput,
    SamplingParams,
    validate_request,
)
from mla_backend.scheduler.schedule_batch import ScheduleBatch
from mla_backend.scheduler.scheduler import Scheduler
from mla_backend.tokenizer import load_tokenizer
from mla_backend.tokenizer.output_processor import OutputProcessor, engine_streams

logger = logging.getLogger(__name__)
# `_extend_as_decode`: the most KV bytes the rows of an extend run as decode rows may read, over
# all layers. Each row reads its whole prefix, so the reads grow with the square of a prompt's
# length: 32 GiB is, for V2-Lite's bf16 latents (31,104 bytes a token over 27 layers), a fresh
# 1,485-token prompt or 128 new tokens over an 8,565-token prefix: about 11 ms at 3 TB/s.
EXTEND_AS_DECODE_MAX_READ_BYTES = 32 << 30
_IDLE_POLL_S = 0.1  # `serve_engine`'s wait for a message while the engine has no work (s)
_NO_TOKEN_FITS = ("structured_outputs: no token the request allows fits its grammar here "
                  "(allowed_token_ids, logit_bias or the vocabulary exclude every token the "
                  "grammar allows)")
# jump-forward: the most forced tokens appended at once (each costs a mask fill on the engine
# thread; a longer forced text goes on in further jumps)
JUMP_MAX_TOKENS = 256
_STATS_EVERY_S = 0.1  # `serve_engine` sends changed counters at most this often while busy (s)


@dataclass
class GenerateResult:
    """Final result of one request from `Engine.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_input_tokens: int
    cached_tokens: int
    cumulative_logprob: float
    error: str | None = None


@dataclass
class _Launched:
    """A batch whose forward and sampling are queued on the device: `rows` are its sampling
    rows, `row_of` maps id(req) to its position among them (the index into the sampled
    tokens); `overlappable`: the next batch may be scheduled and launched before this one's
    tokens are read (a decode batch with no request whose sampling reads its output
    tokens). `deferred`: the logits of its sampling rows, when that waits for the grammars of
    its constrained requests to take the previous batch's tokens; `masks`: their bitmask, being
    filled meanwhile (`_start_deferred`); `_ensure_sample` queues the sampling (`error`: why it
    could not)."""

    batch: ScheduleBatch
    sample: LaunchedSample | None
    rows: list[int]
    row_of: dict[int, int]
    overlappable: bool
    deferred: torch.Tensor | None = None
    masks: PendingMasks | None = None
    error: BaseException | None = None


def _reads_outputs(req: Req) -> bool:
    """The request's next sampling reads its output token ids (repetition / presence /
    frequency penalties). (min_tokens needs only their count, which counts the one in
    flight: `Req.num_inflight_tokens`.)"""
    sp = req.sampling_params
    return (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0)


@dataclass(slots=True)
class _ReqState:
    """Engine-side bookkeeping of a live request (the scheduler's `Req` plus output state; a
    non-streaming request's unsent fields gather its whole output until it ends)."""

    req: Req
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list[float] = field(default_factory=list)
    unsent_top: list[dict[int, float]] = field(default_factory=list)
    queued: bool = False  # in `Engine._unflushed`: it has tokens `_flush_tokens` has not seen


def freeze_startup_objects() -> None:
    """Move every object alive now to the garbage collector's permanent generation
    (`gc.freeze`), so that the full collections Python runs while serving no longer walk them.

    After start-up a process holds ~350,000 tracked objects (torch, transformers and triton
    modules, the model, the tokenizer), and a generation-2 collection walks all of them with the
    GIL held, a few hundred ms each, stalling the engine's steps. An earlier freeze is undone
    first and the garbage collected, so an engine built after another one (tests, benchmarks)
    does not keep the first one's cyclic garbage alive. Called at the end of `Engine.__init__`
    and by the adapter's stub once its model is loaded. Takes one full collection (~0.3 s).
    Also sets the collector's thresholds to `GC_THRESHOLDS` (process-wide, as the freeze).
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def warmup_lengths(cap: int) -> list[int]:
    """`Engine.warm_up`'s prompt lengths up to `cap` tokens: 1, each power of two from 16 and
    one more than it (triton specializes integer arguments divisible by 16, so both kinds of
    length are compiled), and `cap`."""
    out = {1, cap}
    p = 16
    while p <= cap:
        out.update((p, p + 1))
        p *= 2
    return sorted(n for n in out if n <= cap)


class Engine:
    """Args:
        config: the frozen engine configuration.
    Raises:
        ConfigError / ValueError / OSError while loading (bad parameters, missing weights).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = load_tokenizer(config.model.model_path)
        self.vocab_size: int = self.runner.vocab_size
        ids_end = max(len(self.tokenizer), max(self.tokenizer.get_vocab().values()) + 1)
        if ids_end > self.vocab_size:
            logger.warning(
                "the tokenizer's ids reach %d, the model's vocabulary %d: a prompt whose text "
                "tokenizes to an id past it is refused", ids_end - 1, self.vocab_size)
        self.context_len: int = self.runner.context_len
        self.max_total_tokens: int = self.runner.max_total_num_tokens
        eos = self._eos_token_ids()
        self.eos_token_ids: set[int] = eos
        cache_cls = RadixCache if config.cache.enable_radix_cache else ChunkCache
        self.tree_cache = cache_cls(
            self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        )
        self.scheduler = Scheduler(
            config.scheduler,
            cache_enabled=config.cache.enable_radix_cache,
            req_to_token_pool=self.runner.req_to_token_pool,
            allocator=self.runner.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            max_running_requests=self.runner.max_running_requests,
            context_len=self.context_len,
        )
        self.sampler = Sampler(eos, self.vocab_size, self.runner.device, seed=config.runner.seed)
        # CUDA: compile its kernels now, for eager (fp32) and graph-replay (model dtype) logits
        cgr = self.runner.cuda_graph_runner
        self.sampler.warm_up(self.runner.max_running_requests,
                             (torch.float32,) + ((cgr.logits.dtype,) if cgr is not None else ()))
        overlap = config.scheduler.overlap_schedule
        # `overlap_schedule` resolved (off with tensor parallelism: the workers get host copies
        # of the inputs); may be switched between steps (benchmarks do).
        on_cuda = torch.device(self.runner.device).type == "cuda"
        self.overlap: bool = config.parallel.tensor_parallel_size == 1 and (
            overlap == "true" or (overlap == "auto" and on_cuda))
        self.extend_as_decode: str = config.runner.extend_as_decode  # (benchmarks switch it)
        self._kv_cell_bytes = self.runner.token_to_kv_pool.cell_bytes()  # a token, all layers
        # the states of requests with committed tokens `_flush_tokens` has not seen, in the
        # order of their first such token
        self._unflushed: list[_ReqState] = []
        # structured outputs: compiles, waiting requests, masks; and the requests whose grammar
        # refused their token (from _commit_tokens)
        self.grammars = GrammarManager(self.tokenizer, self.vocab_size, eos, pin_memory=on_cuda)
        self._grammar_errors: list[tuple[Req, str]] = []
        # jump-forward: the shortest forced run appended without decode steps (0: off), the
        # requests whose next batch extends their forced tokens (from _commit_tokens, handed to
        # the scheduler after their batch), and the tokens appended so (a counter)
        self.jump_min: int = config.scheduler.jump_forward_min_tokens
        self._jumps: list[Req] = []
        self.num_jump_tokens = 0
        # n > 1: the completions that wait for their first one's prefill (its rid → them),
        # and those to hand to the scheduler at the next step
        self._held: dict[str, list[Req]] = {}
        self._release: list[Req] = []
        self._inflight: _Launched | None = None  # overlap: launched, tokens not yet read
        self._inbox: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._live: dict[str, _ReqState] = {}  # rid → state, engine thread only
        self._num_reading_outputs = 0  # live requests with `_reads_outputs`
        self._known_rids: set[str] = set()  # rids accepted and not yet finished (any thread)
        self._rid_lock = threading.Lock()
        self._closed = False
        # Set once, by the engine thread, on a tensor-parallel failure; read by any thread.
        self.failed: str | None = None
        warmup = config.runner.warmup
        if warmup == "true" or (warmup == "auto" and on_cuda):
            try:
                runs, seconds = self.warm_up()
            except BaseException:
                self.close()  # (tensor-parallel workers, the process group)
                raise
            logger.info("warm-up: %d runs in %.1f s", runs, seconds)
        freeze_startup_objects()

    # ------------------------------------------------------------------ any thread
    def add_request(self, request: GenerateRequest) -> None:
        """Validate, tokenize and queue a request (outputs of token ids; `generate` / `stream`
        add text and stop strings).

        Raises:
            InvalidRequestError: empty prompt, both/neither of text and input_ids, token ids outside
                the vocab, prompt + max_tokens beyond the context length or the KV pool, bad
                sampling values, duplicate request id, engine shut down.
            EngineFailedError: the engine has failed (`failed`).
        """
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        ids = validate_request(request, self.tokenizer, self.vocab_size, self.context_len,
                               self.max_total_tokens)
        self.submit(request.rid, ids, request.sampling_params, request.stream)

    def submit(self, rid: str, prompt_ids: list[int], sampling_params: SamplingParams,
               stream: bool) -> None:
        """Queue a request already checked by `request.validate_request` (the front door's
        path). `stream`: emit its tokens every step (else one output when it ends). With
        `n` > 1 its completions run as the requests `sampling_params.sequences(rid)` (their
        own ids and outputs); the first is prefilled first and the others wait for that, so
        they find the prompt in the radix cache instead of computing it again.

        Raises:
            InvalidRequestError: duplicate request id, engine shut down.
            EngineFailedError: the engine has failed (`failed`).
        """
        if self.failed is not None:
            raise EngineFailedError(self.failed)
        if self._closed:
            raise InvalidRequestError("the engine is shutting down")
        seqs = sampling_params.sequences(rid)
        with self._rid_lock:
            for seq_rid, _ in seqs:
                if seq_rid in self._known_rids:
                    raise InvalidRequestError(f"request id {seq_rid!r} is already in use")
            self._known_rids.update(seq_rid for seq_rid, _ in seqs)
        reqs = [Req(rid=seq_rid, origin_input_ids=list(prompt_ids), sampling_params=sp,
                    stream=stream) for seq_rid, sp in seqs]
        self._inbox.put(("add", reqs))
        self._wakeup.set()

    def abort(self, rid: str) -> None:
        """Abort a request; its final `RequestOutput` (finish_reason ABORT) comes from the next
        `step()`, if it was still unfinished. Unknown ids are ignored."""
        self._inbox.put(("abort", rid))
        self._wakeup.set()

    def wait_for_work(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until there is something to step. Returns has_work()."""
        if self.has_work():
            return True
        self._wakeup.wait(timeout)
        self._wakeup.clear()
        return self.has_work()

    def has_work(self) -> bool:
        """Requests queued or live, a batch in flight, or a request the scheduler still has to
        release (aborted after its batch was handed back)."""
        return (not self._inbox.empty() or bool(self._live) or self._inflight is not None
                or self.scheduler.has_work())

    def shutdown(self) -> None:
        """Refuse new requests; abort every live one on the next step."""
        self._closed = True
        with self._rid_lock:
            rids = list(self._known_rids)
        for rid in rids:
            self.abort(rid)

    def check_health(self) -> str | None:
        """Engine thread, between steps: notice a tensor-parallel worker that died while the
        engine was idle (a cheap liveness check; nothing at TP 1). Once failed, the next
        `step()` ends every live request with the message.

        Returns:
            `failed`: None while healthy, else why the engine stopped.
        """
        if self.failed is None:
            try:
                self.runner.check_workers()
            except TpWorkerError as e:
                self.failed = str(e)
        return self.failed

    def close(self) -> None:
        """Shut down and release what outlives the object: tensor-parallel worker processes and
        the process group (a no-op at TP 1). Call once the engine thread has stopped."""
        self.shutdown()
        self.grammars.shutdown()
        self.runner.close()

    # ------------------------------------------------------------------ engine thread
    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration (at most one forward pass launched).

        Serial (`overlap` off): schedule, forward, sample, record the tokens (stop rules of token
        ids), hand the batch back to the scheduler.

        Overlap schedule (`overlap` on, SGLang's overlap scheduler): the batch launched by the
        previous step is still running on the GPU when this step schedules and launches the
        next one, whose decode rows take their input tokens from the GPU (`future_rows`); only
        then does the host wait for the previous batch's tokens, apply the stop rules (EOS,
        stop token ids, max_tokens, context), hand it to the scheduler and emit them, while the
        GPU computes. So every output leaves one step later, a request ended by EOS runs one
        extra decode row (its token is dropped), and the host's work per step hides behind the
        GPU's. The previous batch is finished first (no overlap for that step) when it was a
        prefill, its requests' sampling reads their output token ids (penalties) or the next
        decode batch could retract; such a batch is completed in its own step, its host work
        overlapping only with what the previous steps left to emit.

        Returns:
            Outputs produced in this step: increments of streaming requests, final outputs of
            finished, aborted and failed requests. Once `failed` is set, only the final error
            outputs of whatever is still live (no forward).
        """
        outputs: list[RequestOutput] = []
        if self.failed is not None:
            self._fail_all_live(outputs)
            return outputs
        self._drain_inbox(outputs)
        if self._release:
            self._release_held(outputs)
        if self.grammars:
            self._admit_compiled(outputs)
        for req in self.scheduler.take_rejected():
            st = self._live.get(req.rid)
            if st is not None:
                outputs.append(self._final_error(
                    st, "request can not be scheduled: it does not fit the KV pool"))
        prev, self._inflight = self._inflight, None
        if prev is not None and (not prev.overlappable or self.scheduler.decode_may_retract()):
            self._complete(prev, outputs)
            prev = None
            if self.failed is not None:
                return outputs
        batch = self.scheduler.get_next_batch()
        cur, error = None, None
        if batch is not None:
            try:
                if prev is not None:  # its sampling before this batch's forward (which may
                    self._ensure_sample(prev)  # overwrite the logits it reads)
                cur = self._launch_batch(batch, prev)
            except Exception as e:  # noqa: BLE001 - failed below, after `prev`
                error = e
        if prev is not None:
            self._complete(prev, outputs)
        if cur is not None and cur.deferred is not None and self.failed is None:
            try:  # the grammars have taken prev's tokens: fill `cur`'s masks (sampled later)
                self._start_deferred(cur)
            except Exception as e:  # noqa: BLE001 - fails the batch below
                error = e
        if batch is not None and error is None and self.failed is None:
            if self.overlap and cur.overlappable:
                self._inflight = cur
            else:
                self._flush_tokens(outputs)  # earlier steps' tokens, while `cur` runs
                self._complete(cur, outputs)
        elif batch is not None:
            self._fail_batch(batch, error or RuntimeError(self.failed), outputs)
        self._flush_tokens(outputs)
        return outputs

    def _launch_batch(self, batch: ScheduleBatch, prev: "_Launched | None") -> "_Launched":
        """Queue the forward pass and the sampling of `batch`; `prev`: the batch still in
        flight whose sampled tokens are the inputs of `batch.future_rows`."""
        as_decode = self._extend_as_decode(batch)
        if as_decode:  # a row per new token: its request's row, the KV up to and with itself
            mode, prefix_lens, extend_lens = ForwardMode.DECODE, None, None
            req_rows = [r for r, n in zip(batch.req_pool_indices, batch.extend_lens)
                        for _ in range(n)]
            seq_lens = [p + 1 for p in batch.positions]
        else:  # (a decode batch's prefix and extend lengths follow from its seq_lens)
            mode, req_rows, seq_lens = batch.forward_mode, batch.req_pool_indices, batch.seq_lens
            prefix_lens, extend_lens = ((None, None) if batch.is_decode()
                                        else (batch.prefix_lens, batch.extend_lens))
        fb = self.runner.make_forward_batch(mode, batch.input_ids, batch.positions, req_rows,
                                            seq_lens, prefix_lens, extend_lens, batch.out_cache_loc)
        if batch.future_rows:
            if prev is None or prev.sample is None:
                raise RuntimeError("a decode row waits for a token no batch in flight samples")
            src = [prev.row_of[id(batch.reqs[i])] for i in batch.future_rows]
            n = len(src)
            idx = int64_on(batch.future_rows + src, fb.input_ids.device)
            fb.input_ids[idx[:n]] = prev.sample.next_ids[idx[n:]]
        logits = self.runner.forward(fb)  # [bs, V]: fp32, or the model dtype (graph replay)
        if batch.is_decode():  # (every decode row samples)
            rows, reqs = list(range(len(batch.reqs))), batch.reqs
        else:
            rows = [i for i, m in enumerate(batch.sample_mask) if m]
            reqs = [batch.reqs[i] for i in rows]
        if as_decode:  # [T, V]: each sampling request's last new token's row
            if rows:
                ends = list(itertools.accumulate(batch.extend_lens))
                logits = logits.index_select(0, int64_on([ends[i] - 1 for i in rows],
                                                         logits.device))
        elif rows and len(rows) != len(batch.reqs):  # (every row samples in decode: no gather)
            logits = logits.index_select(0, int64_on(rows, logits.device))
        sample, deferred = None, None
        if rows:
            constrained = self.grammars.active and any(r.grammar is not None for r in reqs)
            if constrained and prev is not None:
                deferred = logits  # the grammars still wait for prev's tokens
            else:
                sample = self._launch_sample(logits, reqs, self.grammars.start_masks(
                    reqs, background=False, find_single=self.jump_min > 0)
                    if constrained else None)
        for req in reqs:  # 2 while also in the batch still in flight (`prev`)
            req.num_inflight_tokens += 1
        overlappable = batch.is_decode() and not (
            self._num_reading_outputs and any(_reads_outputs(r) for r in reqs))
        return _Launched(batch, sample, rows, {id(r): j for j, r in enumerate(reqs)},
                         overlappable, deferred)

    def _extend_as_decode(self, batch: ScheduleBatch) -> bool:
        """Whether an EXTEND batch runs as a DECODE batch of one row per new token (setting
        `extend_as_decode`). A row's request row and its seq_len (position + 1) make the decode
        attention read exactly the causal prefix of that token: its request's cached tokens and
        the new ones up to it, whose KV each layer stores before it attends (the scheduler has
        written their slots into `req_to_token`). `auto`: when a decode graph fits the T rows
        and the rows' KV reads, sum(position + 1) tokens, stay within
        `EXTEND_AS_DECODE_MAX_READ_BYTES`, so a short prompt's prefill replays a graph instead
        of an eager forward (host-bound whatever the length: docs/benchmarks.md);
        `true`: every extend, eagerly without graphs and with no bound (tests)."""
        mode = self.extend_as_decode
        if mode == "false" or not batch.is_extend():
            return False
        if mode == "true":
            return True
        cgr = self.runner.cuda_graph_runner
        t = batch.num_tokens
        return (cgr is not None and t <= cgr.max_bs and (sum(batch.positions) + t)
                * self._kv_cell_bytes <= EXTEND_AS_DECODE_MAX_READ_BYTES)

    def _start_deferred(self, launched: "_Launched") -> None:
        """The grammars have taken the previous batch's tokens: start filling the masks of
        `launched`'s constrained rows (on the fill thread for a large batch, while this thread
        emits outputs and schedules the next step); `_ensure_sample` queues its sampling."""
        reqs = [launched.batch.reqs[i] for i in launched.rows]
        launched.masks = self.grammars.start_masks(reqs, find_single=self.jump_min > 0)
        if launched.masks is None:  # no row needs one after all (they ended)
            self._ensure_sample(launched)

    def _ensure_sample(self, launched: "_Launched") -> None:
        """Queue the sampling `_launch_batch` deferred, with the masks `_start_deferred`
        started (waiting for their fill); nothing when it is queued already. Raises what the
        fill or the sampler raised (each call, once it has)."""
        if launched.error is not None:
            raise launched.error
        if launched.deferred is None:
            return
        reqs = [launched.batch.reqs[i] for i in launched.rows]
        logits, launched.deferred = launched.deferred, None
        masks, launched.masks = launched.masks, None
        try:
            launched.sample = self._launch_sample(logits, reqs, masks)
        except Exception as e:
            launched.error = e
            raise

    def _launch_sample(self, logits: torch.Tensor, reqs: list[Req],
                       masks: PendingMasks | None) -> LaunchedSample:
        """`Sampler.launch` with the grammar masks (waited for) of the constrained rows."""
        if masks is None:
            return self.sampler.launch(logits, reqs)
        restrict = masks.restrict()
        if self.jump_min > 0:  # (single rows found with the fill: `start_masks(find_single=)`)
            single = [False] * len(masks.rows)
            for k in masks.single():
                single[k] = True
            for k, i in enumerate(masks.rows):
                req = reqs[i]
                req.forced_streak = req.forced_streak + 1 if single[k] else 0
        return self.sampler.launch(logits, reqs, restrict, TokenMasks(masks.rows, masks.bitmask))

    def _complete(self, launched: "_Launched", outputs: list[RequestOutput]) -> None:
        """Wait for a launched batch's tokens, record them (`_commit_tokens`; serially also
        emit them) and hand the batch to the scheduler. A failure fails the batch's requests (a
        tensor-parallel failure: the engine)."""
        batch = launched.batch
        try:
            finished = self._commit_tokens(launched)
            for req, message in self._grammar_errors:  # (the request's constraint: invalid)
                st = self._live.get(req.rid)
                if st is not None:
                    outputs.append(self._final_error(st, message, invalid=True))
            self._grammar_errors.clear()
            if not self.overlap:
                self._flush_tokens(outputs)
        except Exception as e:  # noqa: BLE001 - fail the batch's requests, keep the engine alive
            self._jumps.clear()
            self._fail_batch(batch, e, outputs)
            return
        self.scheduler.process_batch_result(batch, finished)
        if self._jumps:
            for req in self._jumps:
                self.scheduler.start_jump(req)
            self._jumps.clear()

    def _fail_batch(self, batch: ScheduleBatch, error: BaseException,
                    outputs: list[RequestOutput]) -> None:
        """End the batch's live requests with the error and release the batch (its KV is
        discarded). A tensor-parallel failure also fails the engine."""
        self._flush_tokens(outputs)
        if isinstance(error, TpWorkerError):
            self.scheduler.process_batch_result(batch, [True] * len(batch.reqs), failed=True)
            self.failed = str(error)
            self._fail_all_live(outputs)
            return
        for req in batch.reqs:
            st = self._live.get(req.rid)
            if st is not None:
                outputs.append(self._final_error(st, f"Error generating stream: {error!r}"))
        self.scheduler.process_batch_result(batch, [True] * len(batch.reqs), failed=True)

    def _commit_tokens(self, launched: "_Launched") -> list[bool]:
        """Wait for the sampled tokens, append them to their requests and apply the stop rules
        of token ids; queue them for `_flush_tokens`. Returns finished [bs]: the requests the
        scheduler must release (also aborted ones and, with overlap, those EOS ended after this
        batch was scheduled: their token here is dropped)."""
        batch = launched.batch
        finished = [False] * len(batch.reqs)
        for i in launched.rows:
            batch.reqs[i].num_inflight_tokens -= 1
        self._ensure_sample(launched)
        if launched.sample is None:
            return finished
        out = self.sampler.resolve(launched.sample)
        now = time.monotonic()
        reqs, eos, ctx = batch.reqs, self.eos_token_ids, self.context_len
        unflushed, live = self._unflushed, self._live
        tokens, logprobs, tops = out.next_token_ids, out.token_logprobs, out.top_logprobs
        accepted = self._accept_grammar_tokens(reqs, launched.rows, tokens)
        held, jump_streak = self._held, max(2, self.jump_min)
        for j, (i, tok, lp) in enumerate(zip(launched.rows, tokens, logprobs)):
            req = reqs[i]
            if req.finished_reason is not None:  # aborted, or ended one step before (overlap)
                finished[i] = True
                continue
            output_ids = req.output_ids
            output_ids.append(tok)
            req.cumulative_logprob += lp
            sp = req.sampling_params
            n_out = len(output_ids)
            if req.first_token_time is None:
                req.first_token_time = now
            if held and req.rid in held:  # prefilled: its prompt is cached
                self._release += held.pop(req.rid)
            req.last_token_time = now
            if n_out >= sp.min_new_tokens and (
                    (tok in eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
                req.finished_reason = FinishReason.STOP  # (the output processor emits no text)
            elif n_out >= sp.max_new_tokens or len(req.origin_input_ids) + n_out >= ctx:
                req.finished_reason = FinishReason.LENGTH
            if req.grammar is not None:
                if not accepted[j]:
                    req.finished_reason = FinishReason.ABORT
                    self._grammar_errors.append((req, _NO_TOKEN_FITS))
                    finished[i] = True
                    continue
                if req.grammar.is_terminated():  # the grammar took its stop token
                    req.finished_reason = req.finished_reason or FinishReason.STOP
            st = live.get(req.rid)
            if st is not None:  # (None: ended meanwhile; its final output went out)
                st.unsent_ids.append(tok)
                st.unsent_logprobs.append(lp)
                if sp.logprobs is not None:
                    st.unsent_top.append(tops[j] or {})
                if not st.queued:
                    st.queued = True
                    unflushed.append(st)
            # (the look ahead for a run waits for max(2, jump_min) forced tokens in a row: each
            # look costs a mask fill per token, and short runs are not worth one)
            if req.jump_forward and (req.forced_streak >= jump_streak
                                     or req.jump_pending) and req.finished_reason is None:
                self._jump_forward(req)
            finished[i] = req.finished_reason is not None
        return finished

    # ------------------------------------------------------------------ jump-forward
    def _jump_eligible(self, req: Req) -> bool:
        """Jump-forward may append the tokens `req`'s grammar forces: it is on, and the
        output stays what token-by-token decoding gives. Not for requests whose client reads
        logprobs (a forced token's logprob is not computed), a seeded sampled request (its
        generator draws once per decode step: fewer steps, other later draws) or one with
        allowed_token_ids (a forced token it bans ends the request in an error instead)."""
        sp = req.sampling_params
        return (self.jump_min > 0 and sp.logprobs is None and not sp.logprobs_returned
                and sp.allowed_token_ids is None and (sp.seed is None or sp.temperature == 0))

    def _forced_run(self, req: Req, cap: int, may_end: bool) -> list[int]:
        """The tokens `req`'s grammar forces next (`constrained.grammar.forced_tokens`, a
        stop token included), at most `cap` and JUMP_MAX_TOKENS. A token that ends the request
        (EOS, a stop token id) ends the run: kept when `may_end`, else left out (decoded as
        usual)."""
        from mla_backend.constrained.grammar import forced_tokens

        if cap <= 0:
            return []
        run = forced_tokens(req.grammar, max_tokens=min(cap, JUMP_MAX_TOKENS), include_stop=True)
        stops = req.sampling_params.stop_token_ids
        for k, tok in enumerate(run):
            if tok in self.eos_token_ids or tok in stops:
                return run[:k + 1] if may_end else run[:k]
        return run

    def _append_forced(self, req: Req, run: list[int]) -> None:
        """Append forced tokens to `req` as if each had been sampled (its grammar takes
        them; logprob 0.0: under the mask the token has probability 1) and queue them for
        `_flush_tokens`. Ends the request as `_commit_tokens` would for its last token: STOP
        after a stop token (EOS, even with ignore_eos: its grammar is complete then; a stop
        token id), else LENGTH at max_tokens or the context."""
        state = req.grammar
        for tok in run:
            if not state.accept_token(tok):
                raise RuntimeError(f"grammar refused token {tok} it forced")
        req.output_ids.extend(run)
        self.num_jump_tokens += len(run)
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        st = self._live.get(req.rid)
        if st is not None:
            st.unsent_ids.extend(run)
            st.unsent_logprobs.extend([0.0] * len(run))
            if req.sampling_params.logprobs is not None:
                st.unsent_top.extend({} for _ in run)
            if not st.queued:
                st.queued = True
                self._unflushed.append(st)
        n_out = len(req.output_ids)
        if state.is_terminated() or run[-1] in req.sampling_params.stop_token_ids:
            req.finished_reason = FinishReason.STOP
        elif (n_out >= req.sampling_params.max_new_tokens
                or len(req.origin_input_ids) + n_out >= self.context_len):
            req.finished_reason = FinishReason.LENGTH

    def _jump_forward(self, req: Req) -> None:
        """After `req`'s token was committed, the masks of its last max(2, jump_min) tokens
        having allowed only the token they gave (a forced run is likely), or a jump waiting
        for it: when the grammar forces at least `jump_min` more tokens, append
        them and have the scheduler extend them in one step (`Scheduler.start_jump`, after
        this batch). If a token of the request is still in flight (overlap), the run starts
        with it: the request sits out the next decode batch and jumps once it is committed.
        A run that ends the request (a forced stop token) is appended at once, whatever its
        length: no step computes it (a token in flight is dropped, as after any stop)."""
        pending, req.jump_pending, req.forced_streak = req.jump_pending, False, 0
        n_out = len(req.output_ids)
        cap = min(req.sampling_params.max_new_tokens - n_out,
                  self.context_len - len(req.origin_input_ids) - n_out)
        run = self._forced_run(req, cap, may_end=True)
        if not run:
            return
        last = run[-1]
        ends = last in self.eos_token_ids or last in req.sampling_params.stop_token_ids
        if not ends:
            if len(run) < (1 if pending else self.jump_min):
                return
            if req.num_inflight_tokens:
                req.jump_pending = True
                return
        self._append_forced(req, run)
        if req.finished_reason is None:
            self._jumps.append(req)

    def _accept_grammar_tokens(self, reqs: list[Req], rows: list[int],
                               tokens: list[int]) -> dict[int, bool]:
        """The grammars of the constrained live requests among `rows` take their sampled
        tokens (tokens[j] for reqs[rows[j]]), in one call; {j: accepted}."""
        if not self.grammars.active:
            return {}
        js = [j for j, i in enumerate(rows)
              if reqs[i].grammar is not None and reqs[i].finished_reason is None]
        if not js:
            return {}
        oks = self.grammars.accept_tokens([reqs[rows[j]].grammar for j in js],
                                          [tokens[j] for j in js])
        return dict(zip(js, oks))

    def _flush_tokens(self, outputs: list[RequestOutput]) -> None:
        """Emit the tokens committed since the last flush (`_commit_tokens` and jump-forward
        put them in their request's output state): one output per streaming request with new
        tokens and the final output of each finished one; a non-streaming request's tokens stay
        gathered until it ends."""
        states, self._unflushed = self._unflushed, []
        emit = self._emit
        for st in states:
            if not st.queued:  # its final output went out meanwhile (an abort, an error)
                continue
            st.queued = False
            req = st.req
            if req.stream or req.finished_reason is not None:
                outputs.append(emit(st))

    def _emit(self, st: _ReqState) -> RequestOutput:
        req = st.req
        reason = req.finished_reason
        top = st.unsent_top if req.sampling_params.logprobs is not None else None
        # Positional, in field order (cheaper than keywords, per output per step).
        out = RequestOutput(
            req.rid, st.unsent_ids, "", reason is not None, reason,
            len(req.origin_input_ids), len(req.output_ids), req.cached_tokens,
            top, st.unsent_logprobs, req.cumulative_logprob, None, req.first_token_time,
            req.last_token_time,
        )
        st.unsent_ids, st.unsent_logprobs, st.queued = [], [], False
        if top is not None:  # (no list per output for requests without logprobs)
            st.unsent_top = []
        if reason is not None:
            self._forget(req.rid)
        return out

    def _final_error(self, st: _ReqState, message: str, invalid: bool = False) -> RequestOutput:
        """End a live request with `message` (`invalid`: the client's fault)."""
        st.req.finished_reason = FinishReason.ABORT
        self.grammars.drop(st.req.rid)
        out = self._emit(st)
        out.error = message
        out.invalid_request = invalid
        return out

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Hand the requests whose grammar is compiled to the scheduler (a bad grammar ends
        its request with INVALID_ARGUMENT). With nothing else to run, wait a little for one."""
        if not (self.scheduler.has_work() or self._inflight is not None):
            self.grammars.wait()
        for req, error in self.grammars.take_ready():
            st = self._live.get(req.rid)
            if st is None:
                continue
            if error is not None:
                outputs.append(self._final_error(st, error, invalid=True))
                continue
            req.jump_forward = self._jump_eligible(req)
            if req.jump_forward and not req.output_ids:  # what the grammar forces first joins
                n_in = len(req.origin_input_ids)    # the prompt's prefill (the last sampled)
                run = self._forced_run(req, min(req.sampling_params.max_new_tokens - 1,
                                                self.context_len - n_in - 1), may_end=False)
                if run:
                    self._append_forced(req, run)
            self.scheduler.add_request(req)

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                reqs = item  # type: ignore[assignment]
                assert isinstance(reqs, list)
                for req in reqs:
                    self._live[req.rid] = _ReqState(req)
                    self._num_reading_outputs += _reads_outputs(req)
                if len(reqs) > 1:
                    self._held[reqs[0].rid] = reqs[1:]
                self._enqueue(reqs[0], outputs)
            else:
                rid = item
                assert isinstance(rid, str)
                st = self._live.get(rid)
                if st is None or st.req.finished():
                    continue
                self.grammars.drop(rid)
                self.scheduler.abort_request(rid)
                st.req.finished_reason = FinishReason.ABORT
                outputs.append(self._emit(st))

    def _enqueue(self, req: Req, outputs: list[RequestOutput]) -> None:
        """Hand a live request to the scheduler, or first to the grammar compiler."""
        spec = req.sampling_params.structured_outputs
        if spec is None:
            self.scheduler.add_request(req)
            return
        try:  # its grammar compiles off this thread; `_admit_compiled` adds it then
            self.grammars.submit(req)
        except Exception as e:  # noqa: BLE001 - no xgrammar: the request's error
            outputs.append(self._final_error(self._live[req.rid], str(e), invalid=True))

    def _release_held(self, outputs: list[RequestOutput]) -> None:
        """Enqueue the completions whose first one has been prefilled (or has ended)."""
        reqs, self._release = self._release, []
        for req in reqs:
            if req.rid in self._live and not req.finished():
                self._enqueue(req, outputs)

    def _fail_all_live(self, outputs: list[RequestOutput]) -> None:
        """After `failed` was set: end every live request (and any still in the inbox) with the
        message, and release what the scheduler holds for them, so the pools balance."""
        assert self.failed is not None
        if self._inflight is not None:  # its results are not read: discarded
            launched, self._inflight = self._inflight, None
            if launched.masks is not None:  # (its fill must end before the states go)
                with contextlib.suppress(Exception):
                    launched.masks.wait()
            for i in launched.rows:
                launched.batch.reqs[i].num_inflight_tokens -= 1
            self.scheduler.process_batch_result(launched.batch, [True] * len(launched.batch.reqs),
                                                failed=True)
        self._flush_tokens(outputs)
        self._drain_inbox(outputs)
        outputs += self.fail_live(self.failed)
        # The batch boundary: the scheduler releases the aborted running requests here; with
        # nothing left waiting or running there is no batch to run.
        batch = self.scheduler.get_next_batch()
        if batch is not None:
            self.scheduler.process_batch_result(batch, [True] * len(batch.reqs), failed=True)

    def _forget(self, rid: str) -> None:
        if self._held and rid in self._held:  # ended before its prefill: release the others
            self._release += self._held.pop(rid)
        st = self._live.pop(rid, None)
        if st is not None:
            self._num_reading_outputs -= _reads_outputs(st.req)
        with self._rid_lock:
            self._known_rids.discard(rid)

    # ------------------------------------------------------------------ helpers
    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.runner.hf_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    def warm_up(self) -> tuple[int, float]:
        """Run the kinds of prefill the engine will meet once, at load, so that the triton
        kernels they launch (extend attention, the MoE tiles of each rows-per-expert class, the
        absorbed and decompressed MLA paths, an extend over a cached prefix) are compiled now
        instead of in the first requests' steps (a JIT compile takes a fraction of a second to
        seconds per kernel on a machine without triton's disk cache). Decode batches up to
        `cuda_graph_max_bs` are compiled by graph capture and the sampler's kernels by
        `Sampler.warm_up`; without CUDA graphs only the warm-up's own decode steps (batches of
        1 to 3) are. Greedy requests of 2 tokens through the whole engine (`generate`), each
        run to its end before the next: one prompt of each length of `warmup_lengths` (up to
        one chunk, within the context and the pool), one batch of three prompts, then an extend
        over a prefix: with the radix cache a prompt that extends a cached one, without it a
        prompt one chunk and 33 tokens long (its second chunk), where it fits. The prompts are
        token ids, not text. The prefix cache is emptied after (on an engine that has served,
        its cached prefixes go too). Returns (runs, seconds). Called from `__init__` when
        `warmup` is on (by default on CUDA); not with an engine thread running. Its prefill
        steps run eagerly (`extend_as_decode` off while it runs): those are the kernels it is
        for; the decode rows replay graphs, captured already.

        Raises:
            RuntimeError: a warm-up run failed (out of GPU memory: the message says which
                settings to lower), or left KV slots or requests taken (a bug).
            AssertionError: the pools do not balance (`check_invariant`; a bug).
            EngineFailedError: a tensor-parallel worker failed.
        """
        t = time.perf_counter()
        s = self.config.scheduler
        chunk = s.chunked_prefill_size if s.chunked_prefill_size > 0 else s.max_prefill_tokens
        cap = min(chunk, s.max_prefill_tokens, self.context_len - 2, self.max_total_tokens - 2)
        if cap < 1:
            return 0, 0.0
        greedy = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)

        def prompt(n: int, start: int) -> list[int]:  # no two prompts share a first token
            return [(start + 7919 * i) % self.vocab_size for i in range(n)]

        runs = [[prompt(n, n)] for n in warmup_lengths(cap)]
        batch = [prompt(n, cap + 1 + n) for n in (5, 40, 300) if n <= cap]
        if len(batch) > 1:
            runs.append(batch)
        if self.config.cache.enable_radix_cache:
            if len(batch) > 1 and 40 + 33 <= cap:
                runs.append([batch[1] + prompt(33, 3 * cap)])  # its first 40 tokens are cached
        elif s.chunked_prefill_size > 0 and cap == s.chunked_prefill_size and \
                cap + 33 + 2 <= min(self.context_len, self.max_total_tokens):
            runs.append([prompt(cap + 33, 5 * cap)])  # a second chunk over the first
        as_decode, self.extend_as_decode = self.extend_as_decode, "false"
        try:
            for prompts in runs:
                errors = [r.error for r in self.generate(prompts, greedy) if r.error]
                if errors:  # a failed forward ends its requests with the error
                    hint = (" (out of GPU memory, as a request's prefill of that size would be: "
                            "lower mem_fraction_static, chunked_prefill_size or "
                            "max_total_tokens)" if "out of memory" in errors[0].lower() else "")
                    raise RuntimeError(f"the warm-up's prefill of {sum(map(len, prompts))} "
                                       f"tokens failed{hint}: {errors[0]}")
        finally:
            self.extend_as_decode = as_decode
        self.tree_cache.evict(self.tree_cache.evictable_size())
        self.check_invariant()
        free = self.runner.token_to_kv_pool_allocator.available_size()
        if free != self.max_total_tokens or self._live or self._known_rids:
            raise RuntimeError(f"the warm-up left {self.max_total_tokens - free} KV slots and "
                               f"{len(self._live)} requests taken")
        return len(runs), time.perf_counter() - t

    def check_invariant(self) -> None:
        """Raises AssertionError when free + tree-held + request-held != pool size."""
        self.scheduler.check_invariant()

    def stats(self) -> dict[str, int]:
        """Pool and queue counters (tokens and requests; `retractions`: total since start)."""
        return {
            "free_slots": self.runner.token_to_kv_pool_allocator.available_size(),
            "evictable_slots": self.tree_cache.evictable_size(),
            "protected_slots": self.tree_cache.protected_size(),
            "total_slots": self.max_total_tokens,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "live": len(self._live),
            "retractions": self.scheduler.num_retractions,
            "jump_forward_tokens": self.num_jump_tokens,
        }

    def fail_live(self, message: str) -> list[RequestOutput]:
        """Engine thread, after `step()` raised (a bug, not a failed forward): end every live
        request with `message` (their slots are released at the next batch boundary) and return
        their final outputs; the engine goes on."""
        outputs: list[RequestOutput] = []
        for rid, st in list(self._live.items()):
            self.scheduler.abort_request(rid)
            outputs.append(self._final_error(st, message))
        return outputs

    # ------------------------------------------------------------------ in-process API
    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Run prompts (text or token ids) to completion together, with text and stop strings
        (an `OutputProcessor`); for tests and benchmarks. Steps the engine itself: not with a
        concurrent engine thread. Returns one result per prompt and completion: a prompt whose
        params have `n` > 1 gives its n results one after another.

        Raises:
            InvalidRequestError / EngineFailedError: as `add_request`.
        """
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sps = [sampling_params or SamplingParams()] * len(prompts)
        else:
            sps = list(sampling_params)
        processor = OutputProcessor(self.tokenizer)
        rids = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            rid = f"gen-{id(self)}-{time.monotonic_ns()}-{i}"
            self._add_processed(processor, rid, p, sp, stream=False)
            rids += [seq_rid for seq_rid, _ in sp.sequences(rid)]
        acc = {rid: GenerateResult("", [], None, 0, 0, 0.0) for rid in rids}
        stopped: set[str] = set()
        while processor:
            for out in self._step_processed(processor, stopped):
                r = acc[out.rid]
                r.text, r.token_ids = out.new_text, out.new_token_ids
                r.num_input_tokens = out.num_input_tokens
                r.cached_tokens = out.cached_tokens
                r.cumulative_logprob = out.cumulative_logprob
                r.finish_reason, r.error = out.finish_reason, out.error
        self._settle(stopped)
        return [acc[rid] for rid in rids]

    def stream(self, prompt: str | list[int],
               sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Stream one request's outputs, with text and stop strings (steps the engine itself;
        not with an engine thread).

        Raises:
            InvalidRequestError / EngineFailedError: as `add_request`.
        """
        processor = OutputProcessor(self.tokenizer)
        rid = f"stream-{id(self)}-{time.monotonic_ns()}"
        self._add_processed(processor, rid, prompt, sampling_params or SamplingParams(),
                            stream=True)
        stopped: set[str] = set()
        while processor:
            yield from self._step_processed(processor, stopped)
        self._settle(stopped)

    def _add_processed(self, processor: OutputProcessor, rid: str, prompt: str | list[int],
                       sp: SamplingParams, stream: bool) -> None:
        kw: dict[str, Any] = ({"text": prompt} if isinstance(prompt, str)
                              else {"input_ids": list(prompt)})
        ids = validate_request(GenerateRequest(rid=rid, sampling_params=sp, **kw), self.tokenizer,
                               self.vocab_size, self.context_len, self.max_total_tokens)
        for seq_rid, seq_sp in sp.sequences(rid):
            processor.add(seq_rid, ids, seq_sp, stream)
        self.submit(rid, ids, sp, engine_streams(sp, stream))

    def _step_processed(self, processor: OutputProcessor, stopped: set[str]
                        ) -> list[RequestOutput]:
        """One step's outputs through `processor`; requests a stop string ended are aborted
        (and added to `stopped`)."""
        outputs, ended = processor.process(self.step())
        for rid in ended:
            self.abort(rid)
        stopped.update(ended)
        return outputs

    def _settle(self, stopped: set[str]) -> None:
        """Step until the engine has released the requests in `stopped` (their final ABORT
        outputs are not the caller's: a stop string ended them already)."""
        while stopped & self._live.keys():
            self.step()


class Channel(Protocol):
    """One end of the link between an engine's loop (`serve_engine`) and its front door: a
    pipe to another process or a pair of queues in this one. Messages are tuples."""

    def poll(self, timeout_s: float) -> bool: ...  # a message (or EOF) waits; waits <= timeout
    def recv(self) -> tuple: ...  # raises EOFError / OSError when the other end is gone
    def send(self, message: tuple) -> None: ...  # raises OSError when the other end is gone


def serve_engine(channel: Channel, config: EngineConfig) -> None:
    """Build an `Engine` and serve `channel` until ("close",) or the other end goes: the one
    loop body of the engine's front door (`client.EngineClient`), in a child process or a
    thread. The engine is closed on the way out.

    Messages in: ("add", rid, prompt_ids, SamplingParams, stream) (already validated),
    ("abort", rid), ("check",), ("close",). Out: ("ready", facts) or ("load_error", message)
    once; then ("out", [RequestOutput], failed, stats or None) after a step that produced
    outputs or changed `failed` or (at most every `_STATS_EVERY_S`) the counters;
    ("check", verdict or None, stats). A request the engine refuses (duplicate id, failed) gets
    its final error output; a step that raises ends every live request with
    "Error generating stream: <error>" and the loop goes on. `stats` is `Engine.stats()` plus
    the loop's own totals since start (`LoopTimes`: where the loop's busy time went).
    """
    try:
        engine = Engine(config)
    except BaseException as e:  # noqa: BLE001 - the front door fails its load with this message
        channel.send(("load_error", str(e) or repr(e)))
        return
    try:
        workers = engine.runner.tp_workers
        channel.send(("ready", {
            "vocab_size": engine.vocab_size, "context_len": engine.context_len,
            "max_total_tokens": engine.max_total_tokens, "device": str(engine.runner.device),
            "torch_threads": torch.get_num_threads(),
            "tp_worker_pids": None if workers is None else workers.pids(),
            "stats": engine.stats()}))
        _run_loop(engine, channel)
    except (EOFError, OSError):  # the front door is gone
        pass
    finally:
        engine.close()


class LoopTimes:
    """`serve_engine`'s time since start, for profiles of the server path (the adapter logs
    them at unload, `benchmarks/bench_server_path.py` reads them): steps, ms in `Engine.step`,
    ms in `channel.send` of outputs (a send blocks while the other end lags), ms taking
    messages (add / abort / check) while there was work, ms idle (waiting for a message with
    no work) and the outputs sent (a decode row's token is one)."""

    __slots__ = ("steps", "step_s", "send_s", "inbox_s", "idle_s", "outputs")

    def __init__(self) -> None:
        self.steps = self.outputs = 0
        self.step_s = self.send_s = self.inbox_s = self.idle_s = 0.0

    def stats(self) -> dict[str, int]:
        return {"loop_steps": self.steps, "loop_step_ms": round(self.step_s * 1e3),
                "loop_send_ms": round(self.send_s * 1e3),
                "loop_inbox_ms": round(self.inbox_s * 1e3),
                "loop_idle_ms": round(self.idle_s * 1e3), "loop_outputs": self.outputs}


def _run_loop(engine: Engine, channel: Channel) -> None:
    """`serve_engine`'s loop: the channel's messages, then a step (or a health check)."""
    last_stats: dict[str, int] | None = None
    last_stats_t = 0.0
    failed_sent: str | None = None
    times = LoopTimes()
    clock = time.perf_counter
    while True:
        busy = engine.has_work()
        wait = 0.0 if busy else _IDLE_POLL_S
        t0 = clock()
        while channel.poll(wait):
            if not busy:  # the wait for the first message is idle time
                t, busy = clock(), True
                times.idle_s += t - t0
                t0 = t
            message = channel.recv()
            kind = message[0]
            if kind == "close":
                return
            if kind == "add":
                _, rid, ids, sp, stream = message
                try:
                    engine.submit(rid, ids, sp, stream)
                except (InvalidRequestError, EngineFailedError) as e:
                    channel.send(("out", [RequestOutput(rid, [], "", True, error=str(e))],
                                  engine.failed, None))
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "check":
                try:
                    engine.check_invariant()
                    verdict = None
                except AssertionError as e:
                    verdict = f"{e!r}"
                channel.send(("check", verdict, {**engine.stats(), **times.stats()}))
            wait = 0.0
        t1 = clock()
        if busy:
            times.inbox_s += t1 - t0
        else:
            times.idle_s += t1 - t0
        outputs: list[RequestOutput] = []
        if engine.has_work():
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail the live requests, keep serving
                outputs = engine.fail_live(f"Error generating stream: {e!r}")
            times.steps += 1
            times.step_s += clock() - t1
        else:
            engine.check_health()
        now = time.monotonic()
        stats = None
        if now - last_stats_t >= _STATS_EVERY_S or not engine.has_work():
            current = {**engine.stats(), **times.stats()}
            if current != last_stats:
                stats = last_stats = current
                last_stats_t = now
        if outputs or stats is not None or engine.failed != failed_sent:
            failed_sent = engine.failed
            t2 = clock()
            channel.send(("out", outputs, engine.failed, stats))
            times.send_s += clock() - t2
            times.outputs += len(outputs)


__all__ = ["Channel", "Engine", "EngineFailedError", "GenerateResult", "InvalidRequestError",
           "serve_engine"]
