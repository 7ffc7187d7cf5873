"""End-to-end: the adapter's ENGINE_PROCESS and DETOKENIZER_PROCESS settings on a real
tritonserver (issue 5).

One server over a temp repository of deepseek-v2-tiny copies: `dsv2-proc` (ENGINE_PROCESS
default, "true": the engine in a child process of the stub), `dsv2-thread` ("false": the engine
on a thread of the stub) and `dsv2-detok` (DETOKENIZER_PROCESS "true": the outputs' text made in
a second child process; the default, "false", leaves it out). Each streams the text of
an in-process engine and says where its engine runs in the "loaded" log line; the engine process
(and the detokenizer process) are children of their model's stub. Then dsv2-proc's engine
process and dsv2-detok's detokenizer process get SIGKILL while they stream: that request ends
with one error naming the process, a new request to the model fails at once with the same
message, dsv2-thread's concurrent stream and a new one are unaffected, and the server stays
live. At shutdown dsv2-thread's pools balance and the other two say their pools could not be
checked.
"""

from __future__ import annotations

import re
import time

import psutil
import pytest

from mla_tools.tritonserver import TritonServer

from test_tp_worker_death_e2e import SETTINGS, _refused, _serves_baseline, kill_mid_stream
from serving_helpers import write_model

pytestmark = pytest.mark.e2e

PROC, THREAD, DETOK = "dsv2-proc", "dsv2-thread", "dsv2-detok"
FAST_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-process") / "repository"
    write_model(root, PROC, SETTINGS)
    write_model(root, THREAD, SETTINGS, extra_params={"ENGINE_PROCESS": "false"})
    write_model(root, DETOK, SETTINGS, extra_params={"DETOKENIZER_PROCESS": "true"})
    srv = TritonServer(root, wait_models=[PROC, THREAD, DETOK], startup_timeout=300).start()
    yield srv
    srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert re.search(rf"\[mla_backend\] {THREAD}: unloaded; engine stats: [^;]*live=0 [^;]*; "
                     r"pool invariant ok", log)
    assert re.search(rf"\[mla_backend\] {PROC}: unloaded; engine stats \(its last report\): "
                     r"[^;]*; pool invariant not checked \(the engine process \(pid \d+\) exited "
                     r"\(signal 9, SIGKILL\)", log)
    assert re.search(rf"\[mla_backend\] {DETOK}: unloaded; engine stats \(its last report\): "
                     r"[^;]*; pool invariant not checked \(the detokenizer process \(pid \d+\) "
                     r"exited \(signal 9, SIGKILL\)", log)


def _engine_pid(server: TritonServer, model: str = PROC) -> int:
    log = server.log_path.read_text(errors="replace")
    (pid,) = re.findall(rf"\[mla_backend\] {model}: loaded [^\n]*; engine process pid (\d+)",
                        log)
    return int(pid)


def _detokenizer_pid(server: TritonServer) -> int:
    log = server.log_path.read_text(errors="replace")
    (pid,) = re.findall(rf"\[mla_backend\] {DETOK}: loaded [^\n]*; engine process pid \d+, "
                        r"detokenizer process pid (\d+)", log)
    return int(pid)


def _stub_children(server: TritonServer, model: str) -> list[int]:
    stubs = [p for p in psutil.Process(server.proc.pid).children()
             if any(arg == f"{model}_0_0" for arg in p.cmdline())]
    assert len(stubs) == 1
    return [c.pid for c in stubs[0].children()]


def test_both_placements_serve_the_in_process_text(server):
    _serves_baseline(server, PROC)
    _serves_baseline(server, THREAD)
    log = server.log_path.read_text(errors="replace")
    assert re.search(rf"\[mla_backend\] {THREAD}: loaded [^\n]*; engine thread of this process",
                     log)
    assert _engine_pid(server) in _stub_children(server, PROC)
    assert not re.search(rf"\[mla_backend\] {PROC}: loaded [^\n]*detokenizer process", log)
    _serves_baseline(server, DETOK)
    assert {_engine_pid(server, DETOK), _detokenizer_pid(server)} <= set(
        _stub_children(server, DETOK))


def test_killed_engine_process_fails_its_model_only(server):
    pid = _engine_pid(server)
    message = (f"the engine process (pid {pid}) exited (signal 9, SIGKILL); the model must be "
               "reloaded")
    kill_mid_stream(server, PROC, THREAD, pid, message)
    for _ in range(2):
        error, seconds = _refused(server, PROC)
        assert message in error and seconds < FAST_S
    server.check_alive()
    _serves_baseline(server, THREAD)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_killed_detokenizer_process_fails_its_model_only(server):
    pid = _detokenizer_pid(server)
    engine = psutil.Process(_engine_pid(server, DETOK))
    message = (f"the detokenizer process (pid {pid}) exited (signal 9, SIGKILL); the model must "
               "be reloaded")
    kill_mid_stream(server, DETOK, THREAD, pid, message)
    error, seconds = _refused(server, DETOK)
    assert message in error and seconds < FAST_S
    server.check_alive()
    _serves_baseline(server, THREAD)
    deadline = time.monotonic() + 30  # its pipe closed: the engine process ends by itself
    while not _ended(engine):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _ended(proc: psutil.Process) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
