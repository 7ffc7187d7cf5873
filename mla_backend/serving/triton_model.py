"""`TritonPythonModel`: the Triton Python-backend model that serves an `Engine` (decoupled).

Threading follows Triton's official vLLM backend (REFERENCE.md §4.3):

- Triton's execute thread, `execute()`: parses each request (`protocol.parse_request`),
  registers it and calls `Engine.add_request`; a bad request gets one INVALID_ARGUMENT error
  flagged FINAL right there; returns None.
- engine thread: builds the engine (`initialize` waits for it and fails the load with its
  error), then loops `wait_for_work` / `step` and puts each step's `RequestOutput`s on a queue.
  With ENGINE_PROCESS "true" (the default) the engine is an `EngineProcess`: the `Engine` runs in
  a child process with its own GIL (`engine_process.py` says why: per-token sends here stalled
  its steps) and this thread only receives its outputs; with "false" it is an `Engine` and all of
  its torch work runs on this one thread (one OpenMP thread team; see `_engine_main`).
- response thread (`mla-responses`, the dispatcher): decides every response of an accepted
  request but sends none itself. It takes every step's outputs queued so far, merges the
  increments of one request into one (`coalesce`: when sending falls behind the engine, a request
  gets one response carrying several tokens instead of one response per token), decides which
  response is a request's FINAL, turns outputs into responses (`protocol.build_outputs`) and puts
  each on its request's sender queue; it polls `is_cancelled()` of live requests → `Engine.abort`
  + a CANCELLED error flagged FINAL (queued the same way). It also owns the custom metrics
  (`metrics.MetricsRecorder`, flushed at most every `_METRICS_FLUSH_S`) and the per-request
  INFO log line (config parameter `LOG_REQUESTS`, off by default). Backpressure: it takes new engine outputs
  only once every response it queued before its latest round has been sent; until then the
  engine's outputs wait in its queue and are coalesced.
- sender threads (`mla-sender-0` … `mla-sender-<N-1>`, N = `RESPONSE_SENDER_THREADS`): each pops
  its own FIFO queue and calls `InferenceResponseSender.send`, a blocking IPC round trip to the
  tritonserver process (the stub releases the GIL while it waits; the server answers on its
  thread pool), so up to N round trips are in flight at once; a failed send is logged and the
  thread goes on. A request is bound to one queue at registration (round robin by arrival), and
  every response to it (data, FINAL, error, CANCELLED, UNAVAILABLE) goes through that queue: its
  responses keep their order. With N = 1 every response goes out in the dispatcher's order.

NOTE (exactly one FINAL): a request is in `_live` from registration until the response that
carries its FINAL flag; whoever removes it from `_live` (under `_lock`) queues that FINAL (or, in
`finalize` after the sender threads have stopped, sends it), and outputs for an id no longer in
`_live` are dropped — nothing is queued after FINAL. Requests rejected before registration get
their one error response straight from the execute thread.

A tensor-parallel worker or the engine process that dies (`failed`, noticed at the next step
or within 0.1 s when idle) is fatal. The engine thread stops; every live request and every
later one ends with one UNAVAILABLE error carrying the message ("tensor-parallel worker rank 1
(pid N) exited (signal 9, SIGKILL); the model must be reloaded"). The model stays loaded and
"ready" (this Triton, 2.51, has no per-instance health check) but fails every request at once.
With the adapter parameter UNLOAD_ON_FATAL_ERROR "true" — only for servers started with
`--model-control-mode=explicit` — the model also asks Triton to unload it
(`pb_utils.unload_model`), so `v2/models/<name>/ready` turns false while the server and its other
models keep serving; load it again to recover. Not by default: outside explicit mode that call
aborted the whole tritonserver 2.51 process (boost::interprocess::lock_exception in
libtriton_python.so when the next request arrived).

Data: tensors and parameters come from Triton (`pb_utils`), engine settings from config.pbtxt
`parameters` (`EngineConfig.from_parameters`, `model_path` relative to the model's folder);
adapter-only parameters: `REPORT_CUSTOM_METRICS` (default "true"), `LOG_REQUESTS` (default
"false"), `UNLOAD_ON_FATAL_ERROR` (default "false"; see above), `INTRA_OP_THREAD_COUNT` (torch's
intra-op threads; default "auto": on a CPU one fewer than the process's cores, at least 1, on a
GPU torch's default; see `_intra_op_threads`), `ENGINE_PROCESS` (default "true": the engine in
a child process of the stub; "false": on the stub's engine thread), `STREAM_INTERVAL` (default
"1": a streamed response per token; N > 1: after a request's first streamed response, which
goes out at once, each carries at least N tokens (the last one may carry fewer): N times fewer sends, each an IPC
round trip to the server process, for N - 1 steps more latency per delta; as SGLang's
`stream_interval`), `RESPONSE_SENDER_THREADS` (default "4", integer >= 1: the sender threads,
i.e. how many send round trips of different requests may be in flight at once; more threads
overlap more of the per-token IPC waits, at the cost of more stub threads taking the GIL and
server pool threads; 1 sends one response at a time, in the dispatcher's order).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import triton_python_backend_utils as pb_utils  # provided by the Python backend stub

from mla_backend.config import EngineConfig
from mla_backend.engine import (Engine, EngineFailedError, InvalidRequestError,
                                freeze_startup_objects)
from mla_backend.model_executor.model_runner import resolve_device
from mla_backend.request import RequestOutput
from mla_backend.serving.engine_process import EngineProcess
from mla_backend.serving.metrics import FinishedRequest, MetricsRecorder
from mla_backend.serving.protocol import (
    ADAPTER_PARAMETERS,
    INPUT_NAMES,
    OutputOptions,
    ProtocolError,
    build_outputs,
    check_instance_layout,
    coalesce,
    merge_outputs,
    parse_request,
    should_hold,
)
from mla_backend.serving.stub_check import StubEnvironmentError, check_stub_arrays

_QUEUE_WAIT_S = 0.05  # the response thread wakes at least this often (s)
_CANCEL_POLL_S = 0.1  # a round of is_cancelled() polls starts this often (s)
# is_cancelled() is an IPC round trip to tritonserver: one round polls at most this many live
# requests, the next round goes on with the rest (each request is polled every
# ceil(live / _CANCEL_POLL_MAX) rounds).
_CANCEL_POLL_MAX = 16
_FINALIZE_DRAIN_S = 10.0  # how long finalize() waits for aborted requests' final outputs
_STATS_POLL_S = 0.2  # engine stats (gauges) are read this often (s)
# Buffered metrics go to Triton at most this often (s): each counter increment / histogram
# observation is an IPC round trip (~0.1-0.5 ms on the 2-core CPU VM), once per loop was ~3% of
# a core at 30 engine steps per second.
_METRICS_FLUSH_S = 0.1
_DEFAULT_SENDER_THREADS = 4  # RESPONSE_SENDER_THREADS when config.pbtxt does not set it
_JOIN_S = 5.0  # finalize() waits this long for each of its threads (s)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class _Live:
    """One accepted request, from registration to its FINAL response."""

    sender: Any  # pb_utils.InferenceResponseSender
    options: OutputOptions
    prefix: str = ""  # echoed prompt text (non-streaming with echo)
    accepted: bool = False  # Engine.add_request returned; the response thread may use `sender`
    held: RequestOutput | None = None  # streaming increment with no text yet
    arrival: float = field(default_factory=time.monotonic)  # s, monotonic (for metrics)
    first_token: float | None = None  # s, monotonic: first output with tokens seen
    streamed: bool = False  # a response with tokens was queued (STREAM_INTERVAL applies after it)
    prompt_counted: bool = False  # its prompt tokens went into the prompt-token counter
    shard: int = 0  # its sender queue / thread (every response to it goes there, in order)


def _positive_int(parameters: dict[str, Any], key: str, default: int) -> int:
    """An integer >= 1 config.pbtxt parameter (absent or "" → default)."""
    value = str(parameters.get(key, {}).get("string_value", "")).strip()
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise pb_utils.TritonModelException(f"parameter {key}: expected an integer >= 1, "
                                            f"got {value!r}")
    return number


def _intra_op_threads(parameters: dict[str, Any], device: str) -> int | None:
    """INTRA_OP_THREAD_COUNT (as Triton's PyTorch backend names it): torch's intra-op threads for
    this instance's engine. "" / "auto" (default): on a CPU device one fewer than this process
    may use (at least 1), leaving a core to tritonserver, the response thread and the clients;
    on a GPU device None (torch's default; the host does little parallel work). Else an
    integer >= 1.

    Raises:
        pb_utils.TritonModelException: not "auto" nor an integer >= 1.
    """
    value = str(parameters.get("INTRA_OP_THREAD_COUNT", {}).get("string_value", "")).strip()
    if value.lower() in ("", "auto"):
        if resolve_device(device).type != "cpu":
            return None
        return max(1, len(os.sched_getaffinity(0)) - 1)
    return _positive_int(parameters, "INTRA_OP_THREAD_COUNT", 1)


def _flag(parameters: dict[str, Any], key: str, default: bool) -> bool:
    """A "true"/"false" config.pbtxt parameter (case-insensitive; absent or "" → default)."""
    value = str(parameters.get(key, {}).get("string_value", "")).strip().lower()
    if value == "":
        return default
    if value not in ("true", "false"):
        raise pb_utils.TritonModelException(f"parameter {key}: expected true or false, "
                                            f"got {value!r}")
    return value == "true"


class TritonPythonModel:
    """Triton entry points: `initialize`, `execute`, `finalize`."""

    # ------------------------------------------------------------------ initialize
    def initialize(self, args: dict[str, str]) -> None:
        """Build the engine from config.pbtxt and start the engine and response threads.

        Raises:
            pb_utils.TritonModelException / ConfigError: a stub that cannot read tensors under
                this numpy (`stub_check`), not decoupled, bad parameters, missing weights — the
                model then fails to load with that message.
        """
        self.logger = pb_utils.Logger
        try:
            check_stub_arrays(pb_utils)  # before anything slow: a stub that cannot work
        except StubEnvironmentError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "mla_backend models must use model_transaction_policy { decoupled: true }"
            )
        self.model_name = args.get("model_name", "")
        model_dir = args.get("model_repository") or os.path.dirname(__file__)
        params = model_config.get("parameters", {})
        config = EngineConfig.from_parameters(params, base_dir=model_dir,
                                              ignore=ADAPTER_PARAMETERS)
        report_metrics = _flag(params, "REPORT_CUSTOM_METRICS", True)
        self._log_requests = _flag(params, "LOG_REQUESTS", False)
        self._stream_interval = _positive_int(params, "STREAM_INTERVAL", 1)
        self._unload_on_fatal = _flag(params, "UNLOAD_ON_FATAL_ERROR", False)
        if _flag(params, "ENABLE_VLLM_HEALTH_CHECK", False):
            self.logger.log_info(
                "[mla_backend] ENABLE_VLLM_HEALTH_CHECK: accepted, not needed: this model always "
                "checks its engine; a failed engine fails every request with UNAVAILABLE (set "
                "UNLOAD_ON_FATAL_ERROR to also unload the model)")
        self._engine_process = _flag(params, "ENGINE_PROCESS", True)
        self._num_senders = _positive_int(params, "RESPONSE_SENDER_THREADS",
                                          _DEFAULT_SENDER_THREADS)
        try:
            check_instance_layout(args.get("model_instance_kind"),
                                  config.parallel.tensor_parallel_size)
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        if args.get("model_instance_kind") == "GPU" and config.model.device == "auto":
            # KIND_GPU: one engine per GPU, on the device Triton assigned to this instance.
            config = config.replace(device=f"cuda:{args.get('model_instance_device_id', '0')}")
        threads = _intra_op_threads(params, config.model.device)
        t0 = time.monotonic()
        self._running = True
        self._engine_ready = threading.Event()
        self._steps_may_start = threading.Event()  # set once initialize has finished
        self._engine_error: BaseException | None = None
        # The engine is built on the engine thread that steps it: torch work on one thread only
        # (see `_engine_main`).
        self._engine_thread = threading.Thread(
            target=self._engine_main, args=(config, threads), name="mla-engine", daemon=True
        )
        self._engine_thread.start()
        self._engine_ready.wait()
        if self._engine_error is not None:
            raise self._engine_error  # the load fails with the engine's own message
        try:
            self._start_serving(args, config, report_metrics, t0)
        except BaseException:
            self._running = False  # the engine thread returns without stepping
            self._steps_may_start.set()
            self.engine.close()
            raise
        if self._engine_process:  # the stub's own start-up objects (an Engine froze its own)
            freeze_startup_objects()
        self._steps_may_start.set()

    def _start_serving(self, args: dict[str, str], config: EngineConfig, report_metrics: bool,
                       t0: float) -> None:
        """After the engine is built: log it, create the metrics, the request table, the sender
        threads and the response thread."""
        if isinstance(self.engine, EngineProcess):
            device, workers = self.engine.device, self.engine.tp_worker_pids
            threads, where = self.engine.torch_threads, f"engine process pid {self.engine.pid}"
        else:
            device, where = self.engine.runner.device, "engine thread of the stub"
            workers = self.engine.runner.tp_workers
            workers = None if workers is None else workers.pids()
            threads = torch.get_num_threads()
        self.logger.log_info(
            f"[mla_backend] {self.model_name}: loaded {config.model.model_path} on {device} in "
            f"{time.monotonic() - t0:.1f}s; "
            f"context {self.engine.context_len} tokens, KV pool {self.engine.max_total_tokens} "
            f"tokens, radix cache {'on' if config.cache.enable_radix_cache else 'off'}, "
            f"torch intra-op threads {threads}; {where}"
            + ("" if workers is None else f"; tensor-parallel worker pids {workers}")
        )
        self.metrics: MetricsRecorder | None = None
        if report_metrics:
            self.metrics = MetricsRecorder(pb_utils, self.model_name,
                                           str(args.get("model_version", "1")),
                                           self.engine.context_len)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._poll_queue: collections.deque[str] = collections.deque()  # rids to poll next
        self._outputs: queue.SimpleQueue[list[RequestOutput] | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._accepting = True
        self._fatal: str | None = None  # Engine.failed, once the engine thread has seen it
        # (sender, response, flags) per sender thread; None stops the thread.
        self._send_queues: list[queue.SimpleQueue[tuple[Any, Any, int] | None]] = [
            queue.SimpleQueue() for _ in range(self._num_senders)]
        self._queued = 0  # responses queued so far (written by the response thread only)
        self._sent = 0  # of those, sent or failed (under _sent_cond)
        self._sent_cond = threading.Condition()
        self._sender_threads = [
            threading.Thread(target=self._sender_main, args=(i,), name=f"mla-sender-{i}",
                             daemon=True)
            for i in range(self._num_senders)]
        for thread in self._sender_threads:
            thread.start()
        self._response_thread = threading.Thread(
            target=self._response_loop, name="mla-responses", daemon=True
        )
        self._response_thread.start()

    # ------------------------------------------------------------------ execute
    def execute(self, requests: list[Any]) -> None:
        """Hand each request to the engine; never raises; returns None (decoupled)."""
        for request in requests:
            try:
                self._accept(request)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
                self.logger.log_error(f"[mla_backend] unexpected error accepting a request: {e!r}")
        return None

    def _accept(self, request: Any) -> None:
        sender = request.get_response_sender()
        number = next(self._ids)
        rid = f"{request.request_id() or 'req'}#{number}"
        if not self._accepting or self._fatal is not None:
            self._send_error(sender, self._fatal or "the model is shutting down",
                             pb_utils.TritonError.UNAVAILABLE)
            return
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = parse_request(inputs, request.parameters(), rid)
        except ProtocolError as e:
            self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            return
        except Exception as e:  # noqa: BLE001 - still answer the request, exactly once
            self._send_error(sender, f"Error reading the request: {e!r}",
                             pb_utils.TritonError.INTERNAL)
            return
        live = _Live(sender=sender, options=parsed.options, shard=number % self._num_senders)
        with self._lock:
            self._live[rid] = live
        try:
            if parsed.options.echo:  # before add_request: the response may follow at once
                live.prefix = self._prompt_text(parsed.request)
            self.engine.add_request(parsed.request)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self._live.pop(rid, None)
            if isinstance(e, InvalidRequestError):
                self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            elif isinstance(e, EngineFailedError):
                self._send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
            else:
                self._send_error(sender, f"Error adding the request: {e!r}",
                                 pb_utils.TritonError.INTERNAL)
            return
        live.accepted = True

    def _prompt_text(self, request: Any) -> str:
        if request.text is not None:
            return request.text
        try:
            return self.engine.tokenizer.decode(request.input_ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - ids outside the vocab: add_request rejects them
            return ""

    # ------------------------------------------------------------------ engine thread
    def _engine_main(self, config: EngineConfig, threads: int | None) -> None:
        """The engine thread: build the engine, then step it until finalize.

        Every torch operation of the engine (loading, warm-up, graph capture, steps) runs on this
        one thread. Built on the stub's main thread and stepped here, torch's OpenMP runtime
        (libgomp) would keep two thread teams, see more threads than cores and let its workers
        sleep after each parallel region: on a 2-core CPU that halved decode throughput.
        `threads` (INTRA_OP_THREAD_COUNT) caps the intra-op threads before anything runs."""
        try:
            if self._engine_process:
                self.engine = EngineProcess(config, threads)
            else:
                if threads is not None:
                    torch.set_num_threads(threads)
                self.engine = Engine(config)
        except BaseException as e:  # noqa: BLE001 - initialize re-raises it: the load fails
            self._engine_error = e
            return
        finally:
            self._engine_ready.set()
        self._steps_may_start.wait()
        self._engine_loop()

    def _engine_loop(self) -> None:
        while self._running:
            try:
                if not self.engine.wait_for_work(0.1) and self.engine.check_health() is None:
                    continue
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - report, fail live requests, keep serving
                self.logger.log_error(f"[mla_backend] engine step failed: {e!r}")
                self._fail_all(f"Error generating stream: {e!r}")
                time.sleep(0.01)
                continue
            if self.engine.failed is not None:  # before its error outputs reach the responder
                self._fatal = self.engine.failed
            if outputs:
                self._outputs.put(outputs)
            if self._fatal is not None:
                self._on_engine_failed()
                return  # no more steps: the model must be reloaded

    def _on_engine_failed(self) -> None:
        """Log the fatal error and, with UNLOAD_ON_FATAL_ERROR, ask Triton to unload this model
        (see the module docstring); requests are failed by the response thread (`_fail_live`)."""
        if not self._unload_on_fatal:
            self.logger.log_error(f"[mla_backend] {self.model_name}: {self._fatal}; failing every "
                                  "request (reload the model or restart the server)")
            return
        self.logger.log_error(f"[mla_backend] {self.model_name}: {self._fatal}; failing every "
                              "request and unloading the model")
        threading.Thread(target=self._unload_self, name="mla-unload", daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)  # returns once Triton has taken the request
        except Exception as e:  # noqa: BLE001 - not explicit model control: stay, fail fast
            self.logger.log_error(
                f"[mla_backend] {self.model_name}: could not unload itself ({e}); the model "
                "stays loaded and fails every request; reload it or restart the server")

    def _fail_all(self, message: str) -> None:
        """Abort every live request in the engine and end it with an INTERNAL error (queued by
        the response thread, which decides every accepted request's responses)."""
        with self._lock:
            rids = [rid for rid, live in self._live.items() if live.accepted]
        errors = []
        for rid in rids:
            self.engine.abort(rid)
            errors.append(RequestOutput(rid=rid, new_token_ids=[], new_text="", finished=True,
                                        error=message))
        if errors:
            self._outputs.put(errors)

    # ------------------------------------------------------------------ response thread
    def _response_loop(self) -> None:
        """The dispatcher (module docstring): outputs → responses on the sender queues."""
        last_poll = last_stats = last_flush = 0.0
        # self._queued after each of the last two rounds that queued responses: a round takes
        # new outputs once the responses up to the older mark are sent (one round in flight).
        marks: collections.deque[int] = collections.deque([0], maxlen=2)
        while True:
            batch: list[RequestOutput] = []
            stop = False
            if self._wait_sent(marks[0], _QUEUE_WAIT_S):
                try:
                    got = self._outputs.get(timeout=_QUEUE_WAIT_S)
                except queue.Empty:
                    got = []
                if got is None:  # finalize() is done with us
                    return
                batch, stop = self._drain(got)
            for out in coalesce(batch):
                try:
                    self._respond(out)
                except Exception as e:  # noqa: BLE001
                    self.logger.log_error(f"[mla_backend] preparing a response failed: {e!r}")
            if self._fatal is not None:
                self._fail_live(self._fatal)
            now = time.monotonic()
            if now - last_poll >= _CANCEL_POLL_S:
                last_poll = now
                self._poll_cancelled()
            if self.metrics is not None and (now - last_flush >= _METRICS_FLUSH_S or stop):
                last_flush = now
                try:
                    if now - last_stats >= _STATS_POLL_S:
                        last_stats = now
                        self.metrics.set_engine_stats(self.engine.stats())
                    self.metrics.flush()
                except Exception as e:  # noqa: BLE001 - metrics must never stop the responses
                    self.logger.log_error(f"[mla_backend] updating metrics failed: {e!r}")
            if self._queued != marks[-1]:
                marks.append(self._queued)
            if stop:
                return

    def _wait_sent(self, count: int, timeout: float) -> bool:
        """Wait up to `timeout` s until the first `count` queued responses have been sent (or
        their send failed); True when they have."""
        with self._sent_cond:
            return self._sent_cond.wait_for(lambda: self._sent >= count, timeout)

    def _queue_send(self, live: _Live, response: Any, flags: int) -> None:
        """Put one response on `live`'s sender queue (response thread only)."""
        self._queued += 1
        self._send_queues[live.shard].put((live.sender, response, flags))

    def _queue_error(self, live: _Live, message: str, code: int) -> None:
        """Queue `live`'s error response flagged FINAL (the request's last)."""
        self._queue_send(live, self._error_response(message, code), _FINAL)

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

    def _drain(self, batch: list[RequestOutput]) -> tuple[list[RequestOutput], bool]:
        """`batch` plus every batch queued meanwhile (several engine steps when sending fell
        behind); True when finalize's stop marker was among them."""
        batches = [batch]
        while True:
            try:
                more = self._outputs.get_nowait()
            except queue.Empty:
                break
            if more is None:
                return [out for b in batches for out in b], True
            batches.append(more)
        if len(batches) == 1:
            return batch, False
        return [out for b in batches for out in b], False

    def _respond(self, out: RequestOutput) -> None:
        with self._lock:
            live = self._live.get(out.rid)
            if live is None:
                return  # already ended (cancelled or failed): nothing after FINAL
            if out.finished:
                del self._live[out.rid]
        if out.error is not None:
            code = (pb_utils.TritonError.UNAVAILABLE if out.error == self._fatal
                    else pb_utils.TritonError.INTERNAL)
            self._queue_error(live, out.error, code)
            return
        self._account(out, live)
        if not out.finished and self._hold(out, live):
            live.held = merge_outputs(live.held, out)
            return
        out = merge_outputs(live.held, out)
        live.held = None
        tensors = build_outputs(out, live.options, live.prefix, self._decode_token)
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, arr) for name, arr in tensors.items()]
        )
        self._queue_send(live, response, _FINAL if out.finished else 0)
        live.streamed = live.streamed or bool(out.new_token_ids)

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

    def _account(self, out: RequestOutput, live: _Live) -> None:
        """Metrics buffers and the per-request log line for one (non-error) output (no IPC
        except the log line)."""
        now = time.monotonic()
        if live.first_token is None and out.new_token_ids:
            live.first_token = now
        if self.metrics is not None:
            prompt = 0
            if not live.prompt_counted:
                live.prompt_counted = True
                prompt = out.num_input_tokens
            self.metrics.on_output(prompt, len(out.new_token_ids))
        if not out.finished:
            return
        n = out.num_output_tokens
        ttft = None if live.first_token is None else live.first_token - live.arrival
        tpot = None
        if live.first_token is not None and n > 1:
            tpot = (now - live.first_token) / (n - 1)
        done = FinishedRequest(prompt_tokens=out.num_input_tokens, generation_tokens=n,
                               cached_tokens=out.cached_tokens, e2e_s=now - live.arrival,
                               ttft_s=ttft, tpot_s=tpot)
        if self.metrics is not None:
            self.metrics.on_finished(done)
        if self._log_requests:
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
        for live in ended:
            self._queue_error(live, message, pb_utils.TritonError.UNAVAILABLE)

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
            self.engine.abort(rid)
            self._queue_error(live, "Request was cancelled", pb_utils.TritonError.CANCELLED)
            self.logger.log_info(f"[mla_backend] {self.model_name}: request {rid} was cancelled "
                                 "by the client; aborted")

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def _error_response(message: str, code: int) -> Any:
        """An error response (pb_utils.InferenceResponse) with `message` and TritonError `code`."""
        return pb_utils.InferenceResponse(output_tensors=[],
                                          error=pb_utils.TritonError(message, code))

    @classmethod
    def _send_error(cls, sender: Any, message: str, code: int) -> None:
        """Send one error response flagged FINAL (the request's last) on the calling thread:
        only for requests not in `_live` (rejected before registration) or after the sender
        threads have stopped."""
        sender.send(cls._error_response(message, code), flags=_FINAL)

    # ------------------------------------------------------------------ finalize
    def finalize(self) -> None:
        """Stop accepting, abort every live request (each gets its final response), join the
        engine, response and sender threads (the sender threads after sending all they hold) and
        shut the engine down."""
        self._accepting = False
        with self._lock:
            rids = list(self._live)
        self.logger.log_info(f"[mla_backend] {self.model_name}: finalize, aborting {len(rids)} "
                             "live request(s)")
        for rid in rids:
            self.engine.abort(rid)
        deadline = time.monotonic() + _FINALIZE_DRAIN_S
        while time.monotonic() < deadline:
            with self._lock:
                if not self._live:
                    break
            time.sleep(0.02)
        self._running = False
        self._engine_thread.join(timeout=_JOIN_S)
        self._outputs.put(None)
        self._response_thread.join(timeout=_JOIN_S)
        for send_queue in self._send_queues:  # behind everything already queued
            send_queue.put(None)
        for thread in self._sender_threads:
            thread.join(timeout=_JOIN_S)
        stuck = [t.name for t in (self._engine_thread, self._response_thread,
                                  *self._sender_threads) if t.is_alive()]
        if stuck:
            self.logger.log_error(f"[mla_backend] {self.model_name}: threads still running at "
                                  f"unload: {', '.join(stuck)}")
        with self._lock:
            leftovers = list(self._live.items())
            self._live.clear()
        for _, live in leftovers:  # the engine never answered: end them ourselves
            try:
                self._send_error(live.sender, "the model was unloaded",
                                 pb_utils.TritonError.UNAVAILABLE)
            except Exception:  # noqa: BLE001
                pass
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self._log_pool_state()
        self.engine.close()  # shutdown + stop tensor-parallel workers

    def _log_pool_state(self) -> None:
        """Log the engine's counters and its pool invariant (the engine thread has stopped)."""
        label = "engine stats"
        try:
            self.engine.check_invariant()  # first: an engine process sends fresh stats with it
            verdict = "pool invariant ok"
        except EngineFailedError as e:  # the engine process is gone: nothing left to check
            verdict = f"pool invariant not checked ({e})"
            label = "engine stats (its last report)"
        except Exception as e:  # noqa: BLE001
            verdict = f"pool invariant FAILED: {e!r}"
        try:
            stats = " ".join(f"{k}={v}" for k, v in sorted(self.engine.stats().items()))
        except Exception as e:  # noqa: BLE001
            stats = f"unavailable ({e!r})"
        log = self.logger.log_info if verdict.endswith("ok") else self.logger.log_error
        log(f"[mla_backend] {self.model_name}: unloaded; {label}: {stats}; {verdict}")
