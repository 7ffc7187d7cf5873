"""The model refuses to load where the Python-backend stub cannot work (issue 41).

A stub of the nvidia-pytriton 0.7.0 wheel (Triton 2.51) running under numpy 2 builds its input
arrays from the wrong memory and aborts on the first request that carries a BYTES input. The
test builds such an environment (a venv whose own site-packages hold numpy 2 ahead of this
venv's packages, first on tritonserver's PATH, which is how the stub picks its Python) and
checks that loading `deepseek-v2-tiny` then fails with the message of
`mla_backend.serving.stub_check`, while the server itself keeps running. The passing side of the
check runs in every other end-to-end test (numpy 1, the project's pin).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import requests

from mla_backend.serving.stub_check import NUMPY_REQUIREMENT
from mla_tools.tritonserver import TritonServer, server_env
from serving_helpers import write_model

pytestmark = pytest.mark.e2e

NUMPY_2 = "numpy==2.2.6"  # a numpy 2 release with wheels for Python 3.10-3.13


@pytest.fixture(scope="module")
def numpy2_env(tmp_path_factory) -> dict[str, str]:
    """Server environment whose `python3` sees numpy 2 first, then this venv's packages."""
    venv = tmp_path_factory.mktemp("numpy2") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", purelib],
                               capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), NUMPY_2], check=True, timeout=600)
    # This venv's packages (torch, transformers, mla_backend's editable install) after numpy 2.
    (site / "zz_main_venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import numpy, torch; print(numpy.__version__)"],
                           capture_output=True, text=True, check=True)
    assert check.stdout.strip().startswith("2."), check.stdout
    env = server_env()
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env["PATH"]])
    return env


def test_model_refuses_to_load_under_a_numpy_its_stub_cannot_use(tmp_path, numpy2_env):
    write_model(tmp_path, "tiny", {})
    server = TritonServer(tmp_path, env=numpy2_env, model_control_mode="explicit",
                          wait_models=(), startup_timeout=300)
    with server:
        r = requests.post(f"{server.http_url}/v2/repository/models/tiny/load", timeout=300)
        assert r.status_code == 400, r.text
        assert "cannot read tensors under numpy 2.2.6" in r.text, r.text
        assert NUMPY_REQUIREMENT in r.text, r.text
        # The server stays up; the model is simply not there (no stub left to die).
        assert requests.get(f"{server.http_url}/v2/health/live", timeout=30).status_code == 200
        ready = requests.get(f"{server.http_url}/v2/models/tiny/ready", timeout=30)
        assert ready.status_code != 200
    log = server.log_path.read_text(errors="replace")
    assert "terminate called" not in log
