"""End-to-end: a tensor-parallel worker killed while tritonserver serves its model (issue 7).

Each test starts its own server (the model-control mode is what differs) over a temp repository
of deepseek-v2-tiny copies: `dsv2-tp2` (tensor_parallel_size 2: the instance spawns one CPU worker
rank, gloo) and `dsv2-tp1` (TP 1, the bystander). The worker's pid comes from the adapter's
"loaded" log line and must descend from dsv2-tp2's stub process. With a streaming request in
flight on each model, the worker gets SIGKILL; then, in both modes, the in-flight dsv2-tp2
request ends with one error naming the worker (no hang, no response after it; the adapter sends
UNAVAILABLE, but a gRPC stream's error carries only the message), the dsv2-tp1 stream finishes
with the text of an in-process TP 1 engine, dsv2-tp1 serves a new request, and the server stays
live and ready. Then:

- explicit model control, dsv2-tp2 with UNLOAD_ON_FATAL_ERROR "true": it unloads itself, so `v2/models/dsv2-tp2/ready` (and
  tritonclient's HTTP and gRPC `is_model_ready`) turns false and a new request is refused at
  once; its unload still balances the pools; loading it again starts a new worker and serves the
  TP 1 text; stopping the server stops that worker.
- default model control ("none"), default adapter settings (no self-unload: outside explicit
  mode `pb_utils.unload_model` aborted tritonserver): the model stays READY (this Triton, 2.51,
  has no per-instance health check, and the stub is alive anyway), but every new request fails
  at once with the same message.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from mla_backend.config import EngineConfig
from mla_backend.request import SamplingParams
from mla_tools.tritonserver import TritonServer

from test_triton_e2e import Stream, grpc_inputs, is_final, text_of
from serving_helpers import write_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = REPO / "model_repository" / "deepseek-v2-tiny" / "weights"
TP2, TP1 = "dsv2-tp2", "dsv2-tp1"
SETTINGS = {"context_length": "512", "max_total_tokens": "1024", "max_running_requests": "4",
            "chunked_prefill_size": "256", "max_prefill_tokens": "512"}
PROMPT = "Once upon a time, in a small village by the sea,"
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}  # still running at the kill
SHORT_TOKENS = 24
SHORT = {"max_tokens": SHORT_TOKENS, "ignore_eos": True, "temperature": 0}
WAIT_S = 60.0  # the longest any awaited response may take (a hang fails here)
FAST_S = 10.0  # a refused request must be answered within this
# Else tritonserver keeps some HTTP connections open (after a slow model load, after a generate
# that ended in an error) and its shutdown waits 30 s for them.
CLOSE = {"Connection": "close"}


def _message(pid: int) -> str:
    return (f"tensor-parallel worker rank 1 (pid {pid}) exited (signal 9, SIGKILL); the model "
            "must be reloaded")


_BASELINE: list[str] = []


def baseline() -> str:
    """Greedy text of PROMPT with SHORT sampling on an in-process TP 1 engine."""
    if not _BASELINE:
        from mla_backend.engine import Engine

        engine = Engine(EngineConfig.create(model_path=str(WEIGHTS), **SETTINGS))
        sp = SamplingParams(max_new_tokens=SHORT_TOKENS, temperature=0.0, ignore_eos=True)
        _BASELINE.append(engine.generate([PROMPT], sp)[0].text)
        engine.close()
    return _BASELINE[0]


def _start(tmp_path: Path, mode: str | None) -> TritonServer:
    root = tmp_path / "repository"
    # Self-unload only where Triton allows it (outside explicit mode the call aborts the server).
    unload = {"UNLOAD_ON_FATAL_ERROR": "true"} if mode == "explicit" else {}
    write_model(root, TP2, {**SETTINGS, "tensor_parallel_size": "2", **unload})
    write_model(root, TP1, SETTINGS)
    kw = {"model_control_mode": "explicit", "load_models": [TP2, TP1]} if mode else {}
    return TritonServer(root, wait_models=[TP2, TP1], startup_timeout=300, **kw).start()


def _worker_pids(server: TritonServer) -> list[int]:
    """Worker pids of every dsv2-tp2 load so far, from the adapter's "loaded" log lines."""
    log = server.log_path.read_text(errors="replace")
    return [int(m) for m in re.findall(
        rf"\[mla_backend\] {TP2}: loaded [^\n]*tensor-parallel worker pids \[(\d+)\]", log)]


def _check_is_stub_child(server: TritonServer, pid: int) -> None:
    """`pid` descends from dsv2-tp2's stub (a child of its engine process, ENGINE_PROCESS's
    default)."""
    stubs = [p for p in psutil.Process(server.proc.pid).children()
             if any(arg == f"{TP2}_0_0" for arg in p.cmdline())]
    assert len(stubs) == 1, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    assert pid in [c.pid for c in stubs[0].children(recursive=True)]


def _next(stream: Stream, timeout: float = WAIT_S):
    """The stream's next (result, error); fails instead of hanging."""
    try:
        return stream.responses.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no response within {timeout:.0f} s (hang)")


def _until_end(stream: Stream) -> tuple[list, str | None]:
    """Responses up to the FINAL one or the error: (results, error text or None)."""
    results = []
    while True:
        result, error = _next(stream)
        if error is not None:
            return results, str(error)
        results.append(result)
        if is_final(result):
            return results, None


def _refused(server: TritonServer, model: str) -> tuple[str, float]:
    """(error text, seconds) of a new streaming request that must fail."""
    stream = Stream(server.grpc_url)
    try:
        t0 = time.monotonic()
        stream.send(model, grpc_inputs(PROMPT, sampling=SHORT), "late")
        results, error = _until_end(stream)
        assert results == [] and error is not None
        return error, time.monotonic() - t0
    finally:
        stream.close()


def _serves_baseline(server: TritonServer, model: str) -> None:
    stream = Stream(server.grpc_url)
    try:
        stream.send(model, grpc_inputs(PROMPT, sampling=SHORT), "fresh")
        results, error = _until_end(stream)
    finally:
        stream.close()
    assert error is None
    assert text_of(results) == baseline()


def kill_mid_stream(server: TritonServer, victim_model: str, bystander_model: str, pid: int,
                    message: str) -> None:
    """Streams on both models, SIGKILL `pid` after the victim's first token; the victim's
    request must end with one error containing `message` and nothing after it, the bystander's
    must finish with the baseline text."""
    expected = baseline()  # before the kill: not timed against the streams
    victim, bystander = Stream(server.grpc_url), Stream(server.grpc_url)
    try:
        victim.send(victim_model, grpc_inputs(PROMPT, sampling=LONG), "victim")
        bystander.send(bystander_model, grpc_inputs(PROMPT, sampling=SHORT), "bystander")
        first, error = _next(victim)
        assert error is None and not is_final(first) and text_of([first])
        os.kill(pid, signal.SIGKILL)
        results, error = _until_end(victim)
        assert error is not None, f"no error after {len(results)} more responses"
        assert message in error  # (a gRPC stream's error carries no status code)
        assert not any(is_final(r) for r in results)
        with pytest.raises(queue.Empty):  # nothing after the error
            victim.responses.get(timeout=1.0)
        results, error = _until_end(bystander)
        assert error is None and text_of(results) == expected
    finally:
        victim.close()
        bystander.close()


def _kill_worker_mid_stream(server: TritonServer) -> int:
    """`kill_mid_stream` on dsv2-tp2's worker (dsv2-tp1 the bystander). Returns the killed pid."""
    (pid,) = _worker_pids(server)
    _check_is_stub_child(server, pid)
    kill_mid_stream(server, TP2, TP1, pid, _message(pid))
    return pid


def _server_healthy(server: TritonServer) -> None:
    server.check_alive()
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{TP1}/ready"):
        assert requests.get(server.http_url + path, timeout=30).status_code == 200, path


def _ready_http(server: TritonServer, model: str) -> bool:
    return requests.get(f"{server.http_url}/v2/models/{model}/ready", timeout=30).status_code == 200


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_explicit_mode_worker_death_makes_the_model_unready(tmp_path):
    server = _start(tmp_path, "explicit")
    reloaded: int | None = None
    try:
        pid = _kill_worker_mid_stream(server)
        deadline = time.monotonic() + WAIT_S
        while _ready_http(server, TP2):
            assert time.monotonic() < deadline, "dsv2-tp2 still ready after its worker died"
            time.sleep(0.2)
        http = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            assert http.is_model_ready(TP2) is False and grpc.is_model_ready(TP2) is False
            assert http.is_model_ready(TP1) is True and grpc.is_model_ready(TP1) is True
        finally:
            http.close()
            grpc.close()
        while server.model_states()[TP2] != ("UNAVAILABLE", "unloaded"):  # from UNLOADING
            assert time.monotonic() < deadline, server.model_states()[TP2]
            time.sleep(0.2)
        error, seconds = _refused(server, TP2)
        assert f"'{TP2}' has no available versions" in error and seconds < FAST_S
        _server_healthy(server)
        _serves_baseline(server, TP1)
        log = server.log_path.read_text(errors="replace")
        assert (f"[mla_backend] {TP2}: {_message(pid)}; failing every request and unloading "
                "the model") in log
        assert re.search(rf"\[mla_backend\] {TP2}: unloaded; engine stats: [^;]*live=0 "
                         r"[^;]*; pool invariant ok", log)

        r = requests.post(f"{server.http_url}/v2/repository/models/{TP2}/load", json={},
                          timeout=300, headers=CLOSE)
        assert r.status_code == 200, r.text
        pids = _worker_pids(server)
        assert len(pids) == 2 and pids[0] == pid and pids[1] != pid
        reloaded = pids[1]
        _check_is_stub_child(server, reloaded)
        assert _ready_http(server, TP2)
        _serves_baseline(server, TP2)
    finally:
        server.stop()
    if reloaded is not None:
        deadline = time.monotonic() + 30
        while _running(reloaded):
            assert time.monotonic() < deadline, "the reloaded model's worker outlived the server"
            time.sleep(0.2)


def test_default_mode_worker_death_fails_every_request_at_once(tmp_path):
    server = _start(tmp_path, None)
    try:
        pid = _kill_worker_mid_stream(server)
        for _ in range(2):
            error, seconds = _refused(server, TP2)
            assert _message(pid) in error and seconds < FAST_S
        r = requests.post(f"{server.http_url}/v2/models/{TP2}/generate", timeout=FAST_S,
                          json={"text_input": PROMPT, "parameters": SHORT}, headers=CLOSE)
        assert r.status_code == 400 and r.json() == {"error": _message(pid)}
        # No self-unload by default, so still listed READY.
        assert _ready_http(server, TP2) and server.model_states()[TP2][0] == "READY"
        _server_healthy(server)
        _serves_baseline(server, TP1)
        log = server.log_path.read_text(errors="replace")
        assert (f"[mla_backend] {TP2}: {_message(pid)}; failing every request (reload the model "
                "or restart the server)") in log
        assert "unloading the model" not in log
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert re.search(rf"\[mla_backend\] {TP2}: unloaded; engine stats: [^;]*live=0 [^;]*; "
                     r"pool invariant ok", log)
