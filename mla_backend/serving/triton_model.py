"""`TritonPythonModel`: the Triton Python-backend model (decoupled) that serves the engine.

One owner per part: this class reads config.pbtxt and starts the engine's front door
(`client.make_client`: the engine in a child process of the stub, with DETOKENIZER_PROCESS
"true" its outputs' text made in a second one, or on a thread with ENGINE_PROCESS "false") and
the responder (`initialize`); parses each request, registers it with the responder and hands it
to the client, which checks it once (`execute`: a bad request gets one INVALID_ARGUMENT error
flagged FINAL); aborts, drains and closes (`finalize`); ends the stub and
its engine when tritonserver dies without unloading the model (`_watch_server`).
`responder.Responder` owns every response; `client.EngineClient` validation, the engine, text
and stop strings.

A dead tensor-parallel worker, engine or detokenizer process (`EngineClient.failed`) is fatal:
every live and later request ends with one UNAVAILABLE error naming it; the model stays "ready"
(Triton 2.51 has no per-instance health check) unless UNLOAD_ON_FATAL_ERROR "true" makes it
unload itself (`pb_utils.unload_model`; only with `--model-control-mode=explicit`: in other modes
that call aborted tritonserver 2.51, a boost::interprocess::lock_exception in
libtriton_python.so).

Settings: engine ones from config.pbtxt `parameters` (`EngineConfig.from_parameters`,
`model_path` relative to the model's folder); the adapter's own are `protocol.ADAPTER_PARAMETERS`,
each in the README's settings table.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import triton_python_backend_utils as pb_utils  # provided by the Python backend stub

from mla_backend.client import EngineClient, EngineStartError, make_client
from mla_backend.config import EngineConfig
from mla_backend.request import EngineFailedError, InvalidRequestError
from mla_backend.serving.metrics import MetricsRecorder
from mla_backend.serving.protocol import (
    ADAPTER_PARAMETERS,
    INPUT_NAMES,
    ProtocolError,
    check_instance_layout,
    parse_request,
)
from mla_backend.serving.responder import Responder
from mla_backend.serving.stub_check import (
    StubEnvironmentError,
    check_stub_arrays,
    check_stub_imports,
)

_FINALIZE_DRAIN_S = 10.0  # how long finalize() waits for aborted requests' final outputs
_SERVER_WATCH_S = 0.5  # how often the adapter checks that tritonserver is still its parent (s)
_STUB_EXIT_GRACE_S = 5.0  # how long the stub gets to exit by itself once tritonserver is gone (s)
_DEFAULT_SENDER_THREADS = 4  # RESPONSE_SENDER_THREADS when config.pbtxt does not set it


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


def _intra_op_threads(parameters: dict[str, Any]) -> int | None:
    """INTRA_OP_THREAD_COUNT (as Triton's PyTorch backend names it): torch's intra-op threads for
    this instance's engine: "" / "auto" (default) → None (`client.default_torch_threads`), else
    an integer >= 1.

    Raises:
        pb_utils.TritonModelException: not "auto" nor an integer >= 1.
    """
    value = str(parameters.get("INTRA_OP_THREAD_COUNT", {}).get("string_value", "")).strip()
    if value.lower() in ("", "auto"):
        return None
    return _positive_int(parameters, "INTRA_OP_THREAD_COUNT", 1)


def _switch_interval_ms(parameters: dict[str, Any]) -> float | None:
    """GIL_SWITCH_INTERVAL_MS: the stub's `sys.setswitchinterval`, in ms ("" → None: Python's
    own, 5 ms). A thread that blocked (an IPC round trip, a wait for the next request) waits up
    to this long for the GIL while another thread of the stub computes.

    Raises:
        pb_utils.TritonModelException: not a number in (0, 100].
    """
    value = str(parameters.get("GIL_SWITCH_INTERVAL_MS", {}).get("string_value", "")).strip()
    if value == "":
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0.0 < ms <= 100.0:
        raise pb_utils.TritonModelException("parameter GIL_SWITCH_INTERVAL_MS: expected a number "
                                            f"of ms in (0, 100], got {value!r}")
    return ms


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

    def initialize(self, args: dict[str, str]) -> None:
        """Start the engine's front door from config.pbtxt and the response path.

        Raises:
            pb_utils.TritonModelException / ConfigError / EngineStartError: a stub that cannot
                read tensors under this numpy (`stub_check`), not decoupled, bad parameters,
                missing weights: the model then fails to load with that message.
        """
        self.logger = pb_utils.Logger
        try:
            check_stub_arrays(pb_utils)  # before anything slow: a stub that cannot work
            check_stub_imports()
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
        report_metrics = _flag(params, "REPORT_CUSTOM_METRICS", False)
        log_requests = _flag(params, "LOG_REQUESTS", False)
        stream_interval = _positive_int(params, "STREAM_INTERVAL", 1)
        self._unload_on_fatal = _flag(params, "UNLOAD_ON_FATAL_ERROR", False)
        if _flag(params, "ENABLE_VLLM_HEALTH_CHECK", False):
            self.logger.log_info(
                "[mla_backend] ENABLE_VLLM_HEALTH_CHECK: accepted, not needed: this model always "
                "checks its engine; a failed engine fails every request with UNAVAILABLE (set "
                "UNLOAD_ON_FATAL_ERROR to also unload the model)")
        in_process = not _flag(params, "ENGINE_PROCESS", True)
        text_process = _flag(params, "DETOKENIZER_PROCESS", False)
        if text_process and in_process:
            raise pb_utils.TritonModelException(
                'parameter DETOKENIZER_PROCESS "true" needs ENGINE_PROCESS "true": the '
                "detokenizer process sits between the stub and an engine process")
        num_senders = _positive_int(params, "RESPONSE_SENDER_THREADS", _DEFAULT_SENDER_THREADS)
        try:
            check_instance_layout(args.get("model_instance_kind"),
                                  config.parallel.tensor_parallel_size)
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        if args.get("model_instance_kind") == "GPU" and config.model.device == "auto":
            # KIND_GPU: one engine per GPU, on the device Triton assigned to this instance.
            config = config.replace(device=f"cuda:{args.get('model_instance_device_id', '0')}")
        threads = _intra_op_threads(params)
        switch_ms = _switch_interval_ms(params)
        if switch_ms is not None:
            sys.setswitchinterval(switch_ms / 1e3)
        t0 = time.monotonic()
        try:
            self.client: EngineClient = make_client(config, in_process=in_process,
                                                    threads=threads, text_process=text_process)
        except EngineStartError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        try:
            self._log_loaded(config, time.monotonic() - t0)
            metrics = None
            if report_metrics:
                metrics = MetricsRecorder(pb_utils, self.model_name,
                                          str(args.get("model_version", "1")),
                                          self.client.context_len)
            self._ids = itertools.count()
            self._accepting = True
            self.responder = Responder(self.client, self.logger, self.model_name, metrics,
                                       num_senders, stream_interval, log_requests,
                                       on_fatal=self._on_engine_failed)
        except BaseException:
            self.client.close()
            raise
        self._server_pid = os.getppid()
        self._finalized = threading.Event()
        threading.Thread(target=self._watch_server, name="mla-server-watch", daemon=True).start()

    def _log_loaded(self, config: EngineConfig, seconds: float) -> None:
        client = self.client
        workers = client.tp_worker_pids
        self.logger.log_info(
            f"[mla_backend] {self.model_name}: loaded {config.model.model_path} on "
            f"{client.device} in {seconds:.1f}s; context {client.context_len} tokens, KV pool "
            f"{client.max_total_tokens} tokens, radix cache "
            f"{'on' if config.cache.enable_radix_cache else 'off'}, torch intra-op threads "
            f"{client.torch_threads}, GIL switch interval "
            f"{sys.getswitchinterval() * 1e3:g} ms; {client.where}"
            + ("" if workers is None else f"; tensor-parallel worker pids {workers}"))

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
        reject = self.responder.reject  # one FINAL error now, counted in the failure metric
        number = next(self._ids)
        rid = f"{request.request_id() or 'req'}#{number}"
        fatal = self.responder.fatal
        if not self._accepting or fatal is not None:
            reject(sender, fatal or "the model is shutting down", pb_utils.TritonError.UNAVAILABLE)
            return
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            parsed = parse_request(inputs, request.parameters(), rid)
        except ProtocolError as e:
            reject(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            return
        except Exception as e:  # noqa: BLE001 - still answer the request, exactly once
            reject(sender, f"Error reading the request: {e!r}", pb_utils.TritonError.INTERNAL)
            return
        prefix = self._prompt_text(parsed.request) if parsed.options.echo else ""
        # registered first: the response may follow at once
        live = self.responder.register(rid, sender, parsed.options, number, prefix,
                                       parsed.request.sampling_params)
        try:
            self.client.add_request(parsed.request)
        except Exception as e:  # noqa: BLE001
            self.responder.unregister(rid)
            if isinstance(e, InvalidRequestError):
                reject(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            elif isinstance(e, EngineFailedError):
                reject(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
            else:
                reject(sender, f"Error adding the request: {e!r}", pb_utils.TritonError.INTERNAL)
            return
        live.accepted = True

    def _prompt_text(self, request: Any) -> str:
        if request.text is not None:
            return request.text
        try:
            return self.client.tokenizer.decode(request.input_ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - ids outside the vocab: add_request rejects them
            return ""

    # ------------------------------------------------------------------ a failed engine
    def _on_engine_failed(self, message: str) -> None:
        """Log the fatal error and, with UNLOAD_ON_FATAL_ERROR, ask Triton to unload this model
        (see the module docstring); the responder fails the requests."""
        if not self._unload_on_fatal:
            self.logger.log_error(f"[mla_backend] {self.model_name}: {message}; failing every "
                                  "request (reload the model or restart the server)")
            return
        self.logger.log_error(f"[mla_backend] {self.model_name}: {message}; failing every "
                              "request and unloading the model")
        threading.Thread(target=self._unload_self, name="mla-unload", daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)  # returns once Triton has taken the request
        except Exception as e:  # noqa: BLE001 - not explicit model control: stay, fail fast
            self.logger.log_error(
                f"[mla_backend] {self.model_name}: could not unload itself ({e}); the model "
                "stays loaded and fails every request; reload it or restart the server")

    # ------------------------------------------------------------------ a dead server
    def _watch_server(self) -> None:
        """Stop the engine and end this stub once tritonserver has gone without unloading the
        model (killed, or its exit timeout passed with requests in flight). The stub should
        exit by itself then, but the 2.51 stub can deadlock instead: its health thread waits for
        a lock that a cancellation query (`is_cancelled()`) holds while it waits for the dead
        server's answer; the stub and the engine process (and the GPU memory it holds) would then
        stay for good. Logs to stderr (the server's logger is gone too)."""
        while os.getppid() == self._server_pid:
            if self._finalized.wait(_SERVER_WATCH_S):
                return
        if self._finalized.wait(_STUB_EXIT_GRACE_S):  # the stub's own exit path ran finalize
            return
        print(f"[mla_backend] {self.model_name}: tritonserver (pid {self._server_pid}) is gone "
              f"and this stub has not exited in {_STUB_EXIT_GRACE_S:g} s; stopping the engine "
              "and exiting", file=sys.stderr, flush=True)
        try:
            self.client.kill()
        finally:
            os._exit(1)

    # ------------------------------------------------------------------ finalize
    def finalize(self) -> None:
        """Stop accepting, abort every live request (each gets its final response), stop the
        responder (after sending all it holds) and shut the engine down."""
        self._accepting = False
        rids = self.responder.live_rids()
        self.logger.log_info(f"[mla_backend] {self.model_name}: finalize, aborting {len(rids)} "
                             "live request(s)")
        for rid in rids:
            self.client.abort(rid)
        deadline = time.monotonic() + _FINALIZE_DRAIN_S
        while self.responder.num_live() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.responder.stop()
        self._log_pool_state()
        self.client.close()  # aborts what is left, stops tensor-parallel workers
        self._finalized.set()

    def _log_pool_state(self) -> None:
        """Log the engine's counters and its pool invariant (nothing reads its outputs now)."""
        label = "engine stats"
        try:
            self.client.check_invariant()  # first: the engine sends fresh stats with it
            verdict = "pool invariant ok"
        except EngineFailedError as e:  # the engine is gone: nothing left to check
            verdict = f"pool invariant not checked ({e})"
            label = "engine stats (its last report)"
        except Exception as e:  # noqa: BLE001
            verdict = f"pool invariant FAILED: {e!r}"
        try:
            stats = " ".join(f"{k}={v}" for k, v in sorted(self.client.stats().items()))
        except Exception as e:  # noqa: BLE001
            stats = f"unavailable ({e!r})"
        log = self.logger.log_info if verdict.endswith("ok") else self.logger.log_error
        log(f"[mla_backend] {self.model_name}: unloaded; {label}: {stats}; {verdict}")
