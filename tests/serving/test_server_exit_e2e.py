"""When tritonserver ends without unloading the model, the model's stub and engine process end too.

tritonserver ends that way when its exit timeout (`--exit-timeout-secs`, 30 s by default) passes
with a request still in flight: a non-streaming HTTP `generate` keeps running after its client
leaves (tritonserver passes no disconnect to the model), so Ctrl-C then a wait is enough. The
Python-backend stub is meant to notice its dead parent and exit, and its engine process with it
(the engine sees its pipe close). The 2.51 stub can deadlock instead (a cancellation query waits
forever for the dead server's answer while the health thread waits for that query's lock); both
would then stay for good, the engine holding its memory (on a GPU, the next server's KV pool).
`TritonPythonModel._watch_server` ends them.

One server per test over a temp repository with one deepseek-v2-tiny copy, at tensor-parallel
sizes 1 and 2 (the engine's CPU worker rank must end too); the test finds the stub among the
server's child processes and the engine's and the worker's pids in the server log.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from mla_tools.tritonserver import TritonServer

from serving_helpers import wait_gauges, write_model

pytestmark = pytest.mark.e2e

MODEL = "dsv2-exit"
EXIT_TIMEOUT_S = 1
GONE_WITHIN_S = 15.0  # the adapter's check (0.5 s) + the stub's grace (5 s) + slack


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stub_pids(server_pid: int) -> list[int]:
    return [pid for pid in _children(server_pid)
            if b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.parametrize("tp", [1, 2])
def test_stub_and_engine_end_after_a_non_graceful_server_exit(tmp_path, tp):
    write_model(tmp_path, MODEL, {"max_total_tokens": "8192", "tensor_parallel_size": str(tp)})
    server = TritonServer(tmp_path, extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}"],
                          startup_timeout=300).start()
    stubs: list[int] = []
    engines: list[int] = []
    try:
        stubs = _stub_pids(server.proc.pid)
        log = server.log_path.read_text()
        engines = [int(p) for p in re.findall(r"engine process pid (\d+)", log)]
        for workers in re.findall(r"tensor-parallel worker pids \[([\d, ]+)\]", log):
            engines += [int(p) for p in re.findall(r"\d+", workers)]
        assert len(stubs) == 1 and len(engines) == tp, (stubs, engines)  # engine (+ workers)
        assert all(map(_running, stubs + engines))

        def long_generate() -> None:  # runs well past the exit timeout; its answer never comes
            try:
                requests.post(f"{server.http_url}/v2/models/{MODEL}/generate",
                              json={"text_input": "Once upon a time", "max_tokens": 4000,
                                    "ignore_eos": True, "temperature": 0}, timeout=120)
            except requests.RequestException:
                pass

        client = threading.Thread(target=long_generate, daemon=True)
        client.start()
        wait_gauges(server, MODEL, {"running": 1.0}, 60.0)
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(60)
        log = server.log_path.read_text(errors="replace")
        assert "Exit timeout expired" in log  # the way out this test is about
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(map(_running, stubs + engines)):
            assert time.monotonic() < deadline, (
                f"still running {GONE_WITHIN_S:g} s after tritonserver ended: "
                f"{[p for p in stubs + engines if _running(p)]} (stub {stubs}, engine and "
                f"workers {engines})")
            time.sleep(0.2)
        client.join(10)
    finally:
        server.stop()  # the stub is in the server's process group, the engine in one of its own
        for pid in engines:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
