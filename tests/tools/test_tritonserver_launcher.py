"""Tests of mla_tools.tritonserver: a real tritonserver over throwaway python-backend models."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from mla_tools.tritonserver import (
    TritonServer,
    TritonServerError,
    find_tritonserver,
    free_ports,
    prepare_stub,
    server_argv,
)

pytestmark = pytest.mark.e2e

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        {init}

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)
            y = np.array([b"echo:" + v for v in x], dtype=object)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", y)]))
        return out
"""


def _model(repo: Path, name: str, init: str = "pass") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(ECHO.format(init=init)))


def _generate(server: TritonServer, model: str, text: str) -> dict:
    req = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/generate",
        data=json.dumps({"text_input": text}).encode(), method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_find_and_stub() -> None:
    paths = find_tritonserver()
    assert os.access(paths.binary, os.X_OK)
    stub = prepare_stub(paths)
    if paths.stubs_dir is not None:
        want = paths.stubs_dir / f"{sys.version_info.major}.{sys.version_info.minor}"
        assert stub.read_bytes() == (want / stub.name).read_bytes()


def test_argv_and_ports() -> None:
    ports = free_ports(3)
    assert len(set(ports)) == 3
    argv = server_argv(find_tritonserver(), "/x", *ports, host="127.0.0.1",
                       model_control_mode="explicit", load_models=["a"], extra_args=["--foo"])
    assert f"--http-port={ports[0]}" in argv and f"--grpc-port={ports[1]}" in argv
    assert "--model-control-mode=explicit" in argv and argv[-2:] == ["--load-model=a", "--foo"]


def test_serves_and_stops_cleanly(tmp_path: Path) -> None:
    _model(tmp_path / "repo", "echo")
    server = TritonServer(tmp_path / "repo", log_path=tmp_path / "server.log")
    with server:
        assert server.model_states()["echo"][0] == "READY"
        assert _generate(server, "echo", "hi")["text_output"] == "echo:hi"
        # Triton counts the success after the response has left, so the counter may lag it
        want = 'nv_inference_request_success{model="echo",version="1"} 1'
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
                text = r.read().decode()
            if want in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert want in text
        pgid = server.proc.pid
    assert server.proc.returncode == 0
    with pytest.raises(ProcessLookupError):  # no stub left in the server's process group
        os.killpg(pgid, 0)
    assert "successfully unloaded 'echo'" in (tmp_path / "server.log").read_text()


def test_port_clash_retries_with_a_fresh_log(tmp_path: Path) -> None:
    """Triton loads its models before it binds its ports: after a clash, the retry's log must
    not also hold the failed attempt's load lines (a test reading them saw two loads)."""
    _model(tmp_path / "repo", "echo")
    server = TritonServer(tmp_path / "repo", log_path=tmp_path / "server.log")
    taken = server.http_port
    with socket.socket() as holder:
        holder.bind((server.host, taken))
        holder.listen()
        with server:
            assert server.http_port != taken
            assert _generate(server, "echo", "hi")["text_output"] == "echo:hi"
            log = (tmp_path / "server.log").read_text()
    failed = (tmp_path / "server.log.attempt1").read_text()
    assert "successfully loaded 'echo'" in failed and "already in use" in failed
    assert log.count("successfully loaded 'echo'") == 1 and "already in use" not in log


def test_explicit_mode_waits_for_named_model(tmp_path: Path) -> None:
    _model(tmp_path / "repo", "a")
    _model(tmp_path / "repo", "b")
    with TritonServer(tmp_path / "repo", model_control_mode="explicit", load_models=["b"],
                      wait_models=["b"]) as server:
        states = server.model_states()
        assert states["b"][0] == "READY" and states["a"][0] != "READY"
    log_dir = server.log_path.parent
    assert log_dir.is_dir() and log_dir.name.startswith("tritonserver-")
    del server  # a clean session's default log folder goes with the object
    gc.collect()
    assert not log_dir.exists()


def test_failed_model_raises_with_log_tail(tmp_path: Path) -> None:
    _model(tmp_path / "repo", "bad", init='raise ValueError("boom-1234")')
    server = TritonServer(tmp_path / "repo", startup_timeout=120)
    with pytest.raises(TritonServerError, match="boom-1234"):
        server.start()
    assert not server.is_running()
    log = server.log_path
    del server  # a failed start keeps its log
    gc.collect()
    assert "boom-1234" in log.read_text()
    shutil.rmtree(log.parent)


def test_death_during_session_raises(tmp_path: Path) -> None:
    _model(tmp_path / "repo", "echo")
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    before = set(shm.glob("triton_python_backend_shm_region_*"))
    envs_before = set(tmp.glob("python_env_*"))
    server = TritonServer(tmp_path / "repo")
    log = server.log_path
    try:
        with pytest.raises(TritonServerError, match="died"):
            with server:
                os.kill(server.proc.pid, signal.SIGKILL)
                server.proc.wait(10)
        del server
        gc.collect()
        assert log.exists()  # kept: the server died
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
        # A killed server cannot remove its stubs' shared-memory regions nor the Python
        # backend's python_env_* folder: remove ours.
        for region in set(shm.glob("triton_python_backend_shm_region_*")) - before:
            region.unlink(missing_ok=True)
        for folder in set(tmp.glob("python_env_*")) - envs_before:
            shutil.rmtree(folder, ignore_errors=True)
