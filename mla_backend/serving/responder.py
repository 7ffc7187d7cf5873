"""`Responder`: the response path of the Triton adapter, from the engine's outputs to the client.

Owns the table of accepted requests (`_Live`, registration to FINAL) and its threads:
- the response thread (`mla-responses`) decides every response but sends none: it takes the
  front door's outputs (`EngineClient.get_outputs`, text filled) once the responses of its
  previous round are sent (backpressure: meanwhile outputs wait and are coalesced), accounts
  each for the metrics, merges a request's increments (`protocol.coalesce`), applies
  STREAM_INTERVAL, builds responses (`protocol.build_outputs`; n > 1: one element per completion,
  `build_sequence_outputs`) and queues them; it polls `is_cancelled()` → abort + CANCELLED.
- sender threads (`mla-sender-<i>`): each sends its FIFO queue's responses
  (`InferenceResponseSender.send`, a blocking IPC round trip; the stub releases the GIL), so up
  to N are in flight. A request is bound to one queue: its responses keep their order.

Exactly one FINAL: a request is in `_live` until the response with its FINAL flag; whoever
removes it (under `_lock`) queues that FINAL, and outputs for an id not in `_live` are dropped.
When the engine fails for good (`EngineClient.failed`), `on_fatal` is called once and every live
request ends with one UNAVAILABLE error carrying the message. Every error response is counted
(`MetricsRecorder.count_failure`, by its code) before it is queued or sent.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import triton_python_backend_utils as pb_utils  # provided by the Python backend stub

from mla_backend.client import EngineClient
from mla_backend.request import RequestOutput, SamplingParams
from mla_backend.serving.metrics import FinishedRequest, MetricsRecorder, token_gaps
from mla_backend.serving.protocol import (
    OutputOptions,
    build_outputs,
    build_sequence_outputs,
    coalesce,
    merge_outputs,
    should_hold,
)

_QUEUE_WAIT_S = 0.05  # the response thread wakes at least this often (s)
_CANCEL_POLL_S = 0.1  # a round of is_cancelled() polls starts this often (s)
# is_cancelled() is an IPC round trip to tritonserver: one round polls at most this many live
# requests, the next round goes on with the rest.
_CANCEL_POLL_MAX = 16
_STATS_POLL_S = 0.2  # engine stats (gauges) are read this often (s)
# Buffered metrics go to Triton at least this often (s), and before a round's final responses:
# each counter increment / histogram observation is an IPC round trip.
_METRICS_FLUSH_S = 0.1
_JOIN_S = 5.0  # stop() waits this long for each of its threads (s)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class _Live:
    """One accepted request, from registration to its FINAL response."""

    sender: Any  # pb_utils.InferenceResponseSender
    options: OutputOptions
    prefix: str = ""  # echoed prompt text (non-streaming with echo)
    # its sampling parameters (max_tokens and n for the metrics; None: not given, n taken as 1)
    sampling: SamplingParams | None = None
    accepted: bool = False  # the engine took it; the response thread may use `sender`
    held: RequestOutput | None = None  # streaming increment held back (no text yet, interval)
    arrival: float = field(default_factory=time.monotonic)  # s, monotonic (for metrics)
    # Engine time (s, monotonic) of its first token.
    first_token_time: float | None = None
    ttft: float | None = None  # first_token_time − arrival, s
    final_accounted: bool = False  # its finished output went into the metrics
    streamed: bool = False  # a response with tokens was queued (STREAM_INTERVAL applies after it)
    prompt_counted: bool = False  # its prompt tokens went into the prompt-token counter
    shard: int = 0  # its sender queue / thread (every response to it goes there, in order)
    # Per completion (RequestOutput.index; one, 0, unless n > 1): engine time of the last token
    # accounted, and those that ended; the tokens of the completions that ended.
    n: int = 1
    seq_last: dict[int, float] = field(default_factory=dict)
    seq_done: set[int] = field(default_factory=set)
    generated: int = 0
    # n > 1: this round's increments and the latest output, per completion
    pending: dict[int, RequestOutput] = field(default_factory=dict)
    latest: dict[int, RequestOutput] = field(default_factory=dict)


def _no_news(latest: RequestOutput | None, rid: str) -> RequestOutput:
    """A completion's part of a response when it has nothing new: no tokens or text, its
    latest finish state, counts and cumulative logprob."""
    if latest is None:
        return RequestOutput(rid, [], "", False)
    return RequestOutput(
        rid, [], "", latest.finished, latest.finish_reason, latest.num_input_tokens,
        latest.num_output_tokens, latest.cached_tokens,
        None if latest.new_logprobs is None else [],
        None if latest.new_token_logprobs is None else [], latest.cumulative_logprob,
        index=latest.index)


def error_response(message: str, code: int) -> Any:
    """An error response (pb_utils.InferenceResponse) with `message` and TritonError `code`."""
    return pb_utils.InferenceResponse(output_tensors=[],
                                      error=pb_utils.TritonError(message, code))


def failure_reason(code: Any) -> str:
    """The `reason` label (metrics.FAILURE_REASONS) of an error response's TritonError code."""
    E = pb_utils.TritonError
    return {E.INVALID_ARG: "invalid_argument", E.CANCELLED: "cancelled",
            E.UNAVAILABLE: "unavailable"}.get(code, "internal")


def send_error(sender: Any, message: str, code: int) -> None:
    """Send one error response flagged FINAL on the calling thread: only for requests never
    registered (rejected at the door) or after the sender threads have stopped."""
    sender.send(error_response(message, code), flags=_FINAL)


class Responder:
    """Args:
        client: the engine's front door (outputs, abort, stats, token text).
        logger: pb_utils.Logger.
        model_name: for log lines.
        metrics: the custom metrics, or None (REPORT_CUSTOM_METRICS "false").
        num_senders: sender threads (RESPONSE_SENDER_THREADS, >= 1).
        stream_interval: STREAM_INTERVAL (>= 1).
        log_requests: LOG_REQUESTS (one INFO line per finished request).
        on_fatal: called once, on the response thread, with `client.failed` when the engine
            fails for good.
    """

    def __init__(self, client: EngineClient, logger: Any, model_name: str,
                 metrics: MetricsRecorder | None, num_senders: int, stream_interval: int,
                 log_requests: bool, on_fatal: Callable[[str], None]) -> None:
        self.client = client
        self.logger = logger
        self.model_name = model_name
        self.metrics = metrics
        self._stream_interval = stream_interval
        self._log_requests = log_requests
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._poll_queue: collections.deque[str] = collections.deque()  # rids to poll next
        self.fatal: str | None = None  # `client.failed`, once the response thread has seen it
        self._stopping = threading.Event()
        # n > 1 requests with increments gathered this round (`_respond_sequences`)
        self._gathered: dict[str, _Live] = {}
        self._num_senders = num_senders
        # (sender, response, flags) per sender thread; None stops the thread.
        self._send_queues: list[queue.SimpleQueue[tuple[Any, Any, int] | None]] = [
            queue.SimpleQueue() for _ in range(num_senders)]
        self._queued = 0  # responses queued so far (written by the response thread only)
        self._sent = 0  # of those, sent or failed (under _sent_cond)
        self._sent_cond = threading.Condition()
        self._sender_threads = [
            threading.Thread(target=self._sender_main, args=(i,), name=f"mla-sender-{i}",
                             daemon=True)
            for i in range(num_senders)]
        for thread in self._sender_threads:
            thread.start()
        self._response_thread = threading.Thread(target=self._response_loop,
                                                 name="mla-responses", daemon=True)
        self._response_thread.start()

    # ------------------------------------------------------------------ execute thread
    def register(self, rid: str, sender: Any, options: OutputOptions, number: int,
                 prefix: str = "", sampling: SamplingParams | None = None) -> _Live:
        """Add a request to the table before the engine gets it (its outputs may follow at
        once); `number`: its arrival number (picks its sender queue); `sampling`: its sampling
        parameters (the metrics' max_tokens and n)."""
        live = _Live(sender=sender, options=options, prefix=prefix, sampling=sampling,
                     shard=number % self._num_senders,
                     n=1 if sampling is None else sampling.n)
        with self._lock:
            self._live[rid] = live
        return live

    def unregister(self, rid: str) -> None:
        """Drop a request the engine refused (the caller answers it with `reject`)."""
        with self._lock:
            self._live.pop(rid, None)

    def live_rids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def num_live(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ response thread
    def _response_loop(self) -> None:
        """The dispatcher (module docstring): outputs → responses on the sender queues."""
        last_poll = last_stats = last_flush = 0.0
        # self._queued after each of the last two rounds that queued responses: a round takes
        # new outputs once the responses up to the older mark are sent (one round in flight).
        marks: collections.deque[int] = collections.deque([0], maxlen=2)
        while True:
            stop = self._stopping.is_set()
            batch: list[RequestOutput] = []
            if self._wait_sent(marks[0], _QUEUE_WAIT_S):
                batch = self.client.get_outputs(0.0 if stop else _QUEUE_WAIT_S)
            if self.fatal is None and self.client.failed is not None:
                self.fatal = self.client.failed  # before its error outputs are answered
                self._on_fatal(self.fatal)
            if self._account_batch(batch) and self.metrics is not None:
                self._flush_metrics(None)  # the finished requests' metrics before their FINALs
            for out in coalesce(batch):
                try:
                    self._respond(out)
                except Exception as e:  # noqa: BLE001
                    self.logger.log_error(f"[mla_backend] preparing a response failed: {e!r}")
            if self._gathered:
                try:
                    self._respond_sequences()
                except Exception as e:  # noqa: BLE001 - the response thread must go on
                    self.logger.log_error(f"[mla_backend] preparing responses failed: {e!r}")
            if self.fatal is not None:
                self._fail_live(self.fatal)
            now = time.monotonic()
            if now - last_poll >= _CANCEL_POLL_S:
                last_poll = now
                self._poll_cancelled()
            if self.metrics is not None and (now - last_flush >= _METRICS_FLUSH_S or stop):
                last_flush = now
                stats = None
                if now - last_stats >= _STATS_POLL_S:
                    last_stats = now
                    stats = self.client.stats
                self._flush_metrics(stats)
            if self._queued != marks[-1]:
                marks.append(self._queued)
            if stop:
                return

    def _flush_metrics(self, stats: Callable[[], Any] | None) -> None:
        """Send the buffered metrics (after buffering `stats()`, the engine's gauges, when
        given); a failure is logged, never raised."""
        try:
            if stats is not None:
                self.metrics.set_engine_stats(stats())
            self.metrics.flush()
        except Exception as e:  # noqa: BLE001 - metrics must never stop the responses
            self.logger.log_error(f"[mla_backend] updating metrics failed: {e!r}")

    def _wait_sent(self, count: int, timeout: float) -> bool:
        """Wait up to `timeout` s until the first `count` queued responses have been sent (or
        their send failed); True when they have."""
        with self._sent_cond:
            return self._sent_cond.wait_for(lambda: self._sent >= count, timeout)

    def _queue_send(self, live: _Live, response: Any, flags: int) -> None:
        """Put one response on `live`'s sender queue (response thread only)."""
        self._queued += 1
        self._send_queues[live.shard].put((live.sender, response, flags))

    def _queue_error(self, live: _Live, message: str, code: int, counted: bool = False) -> None:
        """Count (unless the caller `counted` it) and queue `live`'s error response flagged
        FINAL (the request's last)."""
        if not counted:
            self._count_failure(code)
        self._queue_send(live, error_response(message, code), _FINAL)

    def reject(self, sender: Any, message: str, code: int) -> None:
        """Answer a request that was never registered (refused at the door) with one error
        flagged FINAL, now, on the calling thread; counted first."""
        self._count_failure(code)
        send_error(sender, message, code)

    def _count_failure(self, code: Any, n: int = 1) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        try:
            metrics.count_failure(failure_reason(code), n)
        except Exception as e:  # noqa: BLE001 - metrics must never stop the responses
            self.logger.log_error(f"[mla_backend] updating metrics failed: {e!r}")

    def _sender_main(self, index: int) -> None:
        """Sender thread `index`: send what its queue holds, in order, until the stop marker
        (None); a send that raises is logged and skipped."""
        send_queue = self._send_queues[index]
        while True:
            item = send_queue.get()
            if item is None:
                return
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception as e:  # noqa: BLE001 - the other requests must still be answered
                self.logger.log_error(f"[mla_backend] sending a response failed: {e!r}")
            with self._sent_cond:
                self._sent += 1
                self._sent_cond.notify_all()

    def _respond(self, out: RequestOutput) -> None:
        with self._lock:
            live = self._live.get(out.rid)
            if live is None:
                return  # already ended (cancelled or failed): nothing after FINAL
            if out.finished and (live.n == 1 or out.error is not None):
                del self._live[out.rid]
        if live.n > 1 and out.error is None:
            live.pending[out.index] = merge_outputs(live.pending.get(out.index), out)
            self._gathered[out.rid] = live
            return
        if out.error is not None and live.n > 1:
            self.client.abort(out.rid)  # one completion failed: the request ends with it
            self._gathered.pop(out.rid, None)
        if out.error is not None:
            code = (pb_utils.TritonError.UNAVAILABLE if out.error == self.fatal
                    else pb_utils.TritonError.INVALID_ARG if out.invalid_request
                    else pb_utils.TritonError.INTERNAL)
            self._queue_error(live, out.error, code)
            return
        if not out.finished and self._hold(out, live):
            live.held = merge_outputs(live.held, out)
            return
        out = merge_outputs(live.held, out)
        live.held = None
        try:
            tensors = build_outputs(out, live.options, live.prefix, self.client.token_text)
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, arr) for name, arr in tensors.items()]
            )
        except Exception as e:  # noqa: BLE001 - the request still gets exactly one FINAL
            self._end_unanswerable(out.rid, live, e)
            return
        self._queue_send(live, response, _FINAL if out.finished else 0)
        live.streamed = live.streamed or bool(out.new_token_ids)

    def _respond_sequences(self) -> None:
        """One response per request with `n` > 1 that got increments this round, with one
        element per completion (`protocol.build_sequence_outputs`; a completion without news
        gets an empty delta and keeps its finish state), flagged FINAL once every completion
        has ended. A non-streaming request gets one response, when the last one ends; with
        STREAM_INTERVAL N > 1, after the first streamed response one goes out once a completion
        has N tokens pending or has ended."""
        gathered, self._gathered = self._gathered, {}
        for rid, live in gathered.items():
            latest = live.latest
            for i, out in live.pending.items():
                latest[i] = out
            done = len(live.seq_done) == live.n  # (accounted before this round's responses)
            if not (live.options.stream or done):
                continue
            if not done and live.streamed and self._stream_interval > 1 and not any(
                    out.finished or len(out.new_token_ids) >= self._stream_interval
                    for out in live.pending.values()):
                continue  # (kept in `pending`: later increments merge into them)
            outs = [live.pending.get(i) or _no_news(latest.get(i), rid) for i in range(live.n)]
            live.pending = {}
            with self._lock:
                if self._live.get(rid) is not live:
                    continue  # cancelled meanwhile: its FINAL went out
                if done:
                    del self._live[rid]
            try:
                tensors = build_sequence_outputs(outs, live.options, live.prefix,
                                                 self.client.token_text)
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, arr) for name, arr in tensors.items()])
            except Exception as e:  # noqa: BLE001 - the request still gets exactly one FINAL
                self._end_unanswerable(rid, live, e)
                continue
            self._queue_send(live, response, _FINAL if done else 0)
            live.streamed = live.streamed or any(out.new_token_ids for out in outs)

    def _end_unanswerable(self, rid: str, live: _Live, error: BaseException) -> None:
        """Building `live`'s response raised: abort the request and end it with one INTERNAL
        error as its FINAL (it left `_live` before the build when that response was to be its
        FINAL; otherwise it leaves now)."""
        self.logger.log_error(f"[mla_backend] preparing a response for {rid} failed: {error!r}")
        with self._lock:
            if self._live.get(rid) is live:
                del self._live[rid]
        self._gathered.pop(rid, None)
        self.client.abort(rid)
        self._queue_error(live, f"Error generating stream: preparing a response failed: "
                                f"{error!r}", pb_utils.TritonError.INTERNAL)

    def _hold(self, out: RequestOutput, live: _Live) -> bool:
        """Keep this unfinished increment for the next response: it has no text yet, or (with
        STREAM_INTERVAL > 1, after the first streamed response) fewer tokens are pending than
        the interval."""
        if should_hold(out, live.options):
            return True
        if self._stream_interval <= 1 or not live.options.stream or not live.streamed:
            return False
        pending = len(out.new_token_ids) + (len(live.held.new_token_ids) if live.held else 0)
        return pending < self._stream_interval

    def _account_batch(self, batch: list[RequestOutput]) -> bool:
        """`_account` each output of live requests (where metrics or LOG_REQUESTS need it), in
        order, before the coalescing (so that an output's engine times give its own token
        gaps); True when one of them finished a request (its metrics must be flushed before its
        FINAL response is queued)."""
        if not batch:
            return False
        now = time.monotonic()
        with self._lock:
            lives = [self._live.get(out.rid) for out in batch]
        finals = False
        # (without metrics or request log lines only the finish states are kept)
        account = self.metrics is not None or self._log_requests
        for out, live in zip(batch, lives):
            # as `_respond`: nothing for ended requests, errors, or after a finished output
            if live is None or live.final_accounted or out.error is not None:
                continue
            final = out.finished
            if final:  # the request ends with its last completion
                live.seq_done.add(out.index)
                final = len(live.seq_done) == live.n
            if final:
                live.final_accounted = finals = True
            if not account:
                continue
            try:
                self._account(out, live, now, final)
            except Exception as e:  # noqa: BLE001 - metrics must never stop the responses
                self.logger.log_error(f"[mla_backend] updating metrics failed: {e!r}")
        return finals

    def _account(self, out: RequestOutput, live: _Live, now: float, final: bool) -> None:
        """Metrics buffers and the per-request log line for one (non-error) engine output, seen
        at `now` (no IPC except the log line).

        Token times are the engine's (`out.first_token_time` / `last_token_time`; `now` where an
        output lacks them): TTFT = first token − arrival, one inter-token latency per token after
        the first (`metrics.token_gaps`, per completion when `n` > 1), e2e = `now` − arrival at
        the output that ends the request (`final`).
        """
        metrics = self.metrics
        k = len(out.new_token_ids)
        if k:
            last = out.last_token_time if out.last_token_time is not None else now
            prev = live.seq_last.get(out.index)
            first = out.first_token_time if out.first_token_time is not None else last
            if live.first_token_time is None:  # this output carries the request's first token
                live.first_token_time = first
                live.ttft = max(first - live.arrival, 0.0)
                if metrics is not None:
                    metrics.on_first_token(live.ttft)
            gap, count = token_gaps(prev, first, last, k)
            live.seq_last[out.index] = last
            if metrics is not None:
                metrics.on_token_gaps(gap, count)
        if metrics is not None:
            prompt = 0
            if not live.prompt_counted:
                live.prompt_counted = True
                prompt = out.num_input_tokens
            metrics.on_output(prompt, k)
        if out.finished:
            live.generated += out.num_output_tokens
        if not final:
            return
        n = live.generated
        sampling = live.sampling
        done = FinishedRequest(prompt_tokens=out.num_input_tokens, generation_tokens=n,
                               cached_tokens=out.cached_tokens, e2e_s=now - live.arrival,
                               max_tokens=None if sampling is None else sampling.max_new_tokens,
                               n=1 if sampling is None else sampling.n)
        if metrics is not None:
            metrics.on_finished(done)
        if self._log_requests:
            tpot = None  # mean inter-token latency (engine times)
            last = max(live.seq_last.values(), default=None)
            if n > 1 and live.first_token_time is not None and last is not None:
                tpot = (last - live.first_token_time) / (n - 1)
            ttft = live.ttft
            reason = out.finish_reason.value if out.finish_reason else "None"
            self.logger.log_info(
                f"[mla_backend] {self.model_name}: request {out.rid} finished ({reason}): "
                f"prompt_tokens={done.prompt_tokens} cached_tokens={done.cached_tokens} "
                f"output_tokens={n} ttft_s={-1.0 if ttft is None else ttft:.4f} "
                f"tpot_s={-1.0 if tpot is None else tpot:.4f} e2e_s={done.e2e_s:.4f}")

    def _fail_live(self, message: str) -> None:
        """The engine has failed: end every accepted request the engine's own final outputs
        did not reach (e.g. one added while it was failing) with one UNAVAILABLE error."""
        with self._lock:
            rids = [rid for rid, live in self._live.items() if live.accepted]
            ended = [self._live.pop(rid) for rid in rids]
        if ended:
            self._count_failure(pb_utils.TritonError.UNAVAILABLE, len(ended))  # one IPC for all
        for live in ended:
            self._queue_error(live, message, pb_utils.TritonError.UNAVAILABLE, counted=True)

    def _poll_cancelled(self) -> None:
        """Poll is_cancelled() of the next _CANCEL_POLL_MAX accepted live requests (round
        robin); abort and answer CANCELLED those the client cancelled."""
        with self._lock:
            if not self._poll_queue:
                self._poll_queue.extend(rid for rid, live in self._live.items() if live.accepted)
            candidates = []
            while self._poll_queue and len(candidates) < _CANCEL_POLL_MAX:
                rid = self._poll_queue.popleft()
                live = self._live.get(rid)
                if live is not None:
                    candidates.append((rid, live))
        for rid, live in candidates:
            try:
                cancelled = live.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - the sender is gone: treat as cancelled
                cancelled = True
            if not cancelled:
                continue
            with self._lock:
                if self._live.pop(rid, None) is None:
                    continue  # finished meanwhile; its FINAL was queued
            self.client.abort(rid)
            self._queue_error(live, "Request was cancelled", pb_utils.TritonError.CANCELLED)
            self.logger.log_info(f"[mla_backend] {self.model_name}: request {rid} was cancelled "
                                 "by the client; aborted")

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop the response thread (after one last round), then the sender threads after
        sending all they hold; requests still live get UNAVAILABLE ("the model was unloaded");
        close the metrics."""
        self._stopping.set()
        self._response_thread.join(timeout=_JOIN_S)
        for send_queue in self._send_queues:  # behind everything already queued
            send_queue.put(None)
        for thread in self._sender_threads:
            thread.join(timeout=_JOIN_S)
        stuck = [t.name for t in (self._response_thread, *self._sender_threads) if t.is_alive()]
        if stuck:
            self.logger.log_error(f"[mla_backend] {self.model_name}: threads still running at "
                                  f"unload: {', '.join(stuck)}")
        with self._lock:
            leftovers = list(self._live.values())
            self._live.clear()
        for live in leftovers:  # the engine never answered: end them here
            try:
                self.reject(live.sender, "the model was unloaded",
                            pb_utils.TritonError.UNAVAILABLE)
            except Exception:  # noqa: BLE001
                pass
        metrics, self.metrics = self.metrics, None  # (a thread still running sees None)
        if metrics is not None:
            metrics.close()
