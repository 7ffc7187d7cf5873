"""Find, prepare and launch the tritonserver binary (not part of the engine).

Owns the process-level plumbing around Triton Inference Server for the set-up script, the demo and
the end-to-end tests:

- `find_tritonserver()` locates the server. Order: `$MLA_TRITONSERVER_ROOT`, the copy shipped in the
  `nvidia-pytriton` wheel (`site-packages/pytriton/tritonserver`, what `./build.sh setup` installs),
  then the official container's `/opt/tritonserver`.
- `prepare_stub()` puts the Python-backend stub built for the running interpreter's X.Y next to
  `libtriton_python.so` (the wheel ships one stub per Python version) and checks with `ldd` that the
  shared libraries it needs (notably `libpythonX.Y.so.1.0`) are found.
- `server_env()`: the venv's bin first on PATH, the repo on PYTHONPATH and, for a shared-library
  Python (pyenv's), its own libpython first on LD_LIBRARY_PATH: the stub must embed the very
  libpython whose stdlib it loads (Debian's 3.11.2 libpython cannot load pyenv 3.11.7's `_ssl`).
- `TritonServer` is a context manager that starts a server over a model repository on free (or
  given) ports, logs to a file, waits until the server and its models are ready, and stops it.
- `python -m mla_tools.tritonserver serve ...` replaces itself with tritonserver in the
  foreground (used by `./build.sh serve`); `demo` starts a server and streams one prompt per model.

The stub embeds the interpreter it finds first on `PATH` as `python3`; putting this interpreter's
bin folder (the venv's) first on `PATH` makes the stub use the venv's site-packages, so `model.py`
can import `mla_backend`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = "What is the capital of France?"
# `demo` prompts per model (others get DEFAULT_PROMPT): deepseek-v2-tiny was trained on State of
# the Union addresses and Moby-Dick (checkpoints/deepseek-v2-tiny/README.md), so it is given the
# opening those addresses share.
DEMO_PROMPTS = {"deepseek-v2-tiny": "Fellow-Citizens of the Senate and House of Representatives:"}
_ERROR_LINE = re.compile(r"E\d{4} ")  # an error-level line of tritonserver's log


class TritonServerError(RuntimeError):
    """tritonserver is missing, cannot start, died, or did not become ready in time."""


@dataclass(frozen=True)
class TritonPaths:
    """Where the server's files are.

    Attributes:
        root: the folder holding `bin/` and `backends/`.
        binary: the `tritonserver` executable.
        backends_dir: value for `--backend-directory`.
        python_backend_dir: folder of `libtriton_python.so` and the stub.
        stubs_dir: per-Python-version stubs (`<X.Y>/triton_python_backend_stub`); None when the
            install has a single stub (the official container).
    """

    root: Path
    binary: Path
    backends_dir: Path
    python_backend_dir: Path
    stubs_dir: Path | None

    @property
    def stub(self) -> Path:
        return self.python_backend_dir / "triton_python_backend_stub"


def _paths_from_root(root: Path) -> TritonPaths | None:
    binary = root / "bin" / "tritonserver"
    backends = root / "backends"
    if not (binary.is_file() and (backends / "python" / "libtriton_python.so").is_file()):
        return None
    stubs = root / "python_backend_stubs"
    stubs_dir = stubs if stubs.is_dir() else None
    return TritonPaths(root, binary, backends, backends / "python", stubs_dir)


def find_tritonserver() -> TritonPaths:
    """Locate tritonserver and its backends.

    Returns:
        TritonPaths of the first install found ($MLA_TRITONSERVER_ROOT, the nvidia-pytriton wheel,
        /opt/tritonserver).
    Raises:
        TritonServerError: no install with `bin/tritonserver` and the Python backend was found.
    """
    candidates: list[Path] = []
    if os.environ.get("MLA_TRITONSERVER_ROOT"):
        candidates.append(Path(os.environ["MLA_TRITONSERVER_ROOT"]))
    # find_spec on the top-level package does not import it (its __init__ needs deps that
    # `pip install --no-deps nvidia-pytriton` leaves out).
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "tritonserver" for p in spec.submodule_search_locations]
    candidates.append(Path("/opt/tritonserver"))
    for root in candidates:
        paths = _paths_from_root(root)
        if paths is not None:
            return paths
    raise TritonServerError(
        "tritonserver not found (looked in: " + ", ".join(map(str, candidates)) + "). "
        "Run `./build.sh setup` (installs the nvidia-pytriton wheel, which ships tritonserver) "
        "or set MLA_TRITONSERVER_ROOT to a folder with bin/tritonserver and backends/python/."
    )


def python_libdir() -> Path | None:
    """Folder of this interpreter's own `libpythonX.Y.so.1.0`; None for a static build or a
    system folder.

    The stub must embed the same libpython as the interpreter whose stdlib and extension modules
    it loads: e.g. pyenv's 3.11.7 `_ssl` module fails to load (undefined symbol `_PyModule_Add`)
    under Debian's 3.11.2 libpython. Putting this folder first on LD_LIBRARY_PATH selects it.
    """
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    # A system folder is searched anyway; putting it first could shadow tritonserver's own libs.
    if libdir and soname and (Path(libdir) / soname).is_file():
        return None if libdir.startswith(("/usr/lib", "/lib")) else Path(libdir)
    return None


def missing_libraries(binary: Path, env: dict[str, str] | None = None) -> list[str]:
    """Shared libraries `ldd` reports as 'not found' for `binary` under `env` (the server's
    environment by default); empty if ldd is absent."""
    if shutil.which("ldd") is None:
        return []
    out = subprocess.run(
        ["ldd", str(binary)], capture_output=True, text=True, check=False,
        env=server_env() if env is None else env,
    ).stdout
    return [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]


def _debian_package(lib: str) -> str | None:
    # libpython3.11.so.1.0 -> libpython3.11 ; libb64.so.0d -> libb64-0d
    if lib.startswith("libpython"):
        return lib.split(".so")[0]
    if lib.startswith("libb64.so."):
        return "libb64-" + lib.rsplit(".so.", 1)[1]
    return None


def prepare_stub(paths: TritonPaths | None = None) -> Path:
    """Install the Python-backend stub for this interpreter and check its libraries.

    Copies `python_backend_stubs/<X.Y>/triton_python_backend_stub` over the stub next to
    `libtriton_python.so` when they differ (atomic rename, safe while another server runs).

    Returns:
        Path of the stub in use.
    Raises:
        TritonServerError: no stub for this Python version, or a library the stub needs is missing
            (the message names it and the Debian package to install).
    """
    paths = paths or find_tritonserver()
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    if paths.stubs_dir is not None:
        src = paths.stubs_dir / pyver / "triton_python_backend_stub"
        if not src.is_file():
            have = sorted(p.name for p in paths.stubs_dir.iterdir() if p.is_dir())
            raise TritonServerError(
                f"no Python-backend stub for Python {pyver} in {paths.stubs_dir} (have: {have}); "
                "create the venv with one of those Python versions"
            )
        dst = paths.stub
        if not dst.is_file() or src.read_bytes() != dst.read_bytes():
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            shutil.copyfile(src, tmp)
            tmp.chmod(0o755)
            os.replace(tmp, dst)
    missing = missing_libraries(paths.stub)
    if missing:
        hints = [f"{lib} (Debian package: {_debian_package(lib) or '?'})" for lib in missing]
        raise TritonServerError(
            f"the Python-backend stub {paths.stub} needs missing libraries: {', '.join(hints)}. "
            "Install them, e.g. `apt-get update && apt-get install -y "
            + " ".join(p for p in map(_debian_package, missing) if p)
            + "` (./build.sh setup does this when run as root). A libpython must be the one of "
            "the venv's interpreter (same X.Y.Z): prefer a Python built with --enable-shared."
        )
    return paths.stub


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: this interpreter's bin first on PATH, the repo on PYTHONPATH,
    this interpreter's libpython folder (if it is a shared build) first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    env["PATH"] = os.pathsep.join([bin_dir] + path)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    libdir = python_libdir()
    if libdir is not None:
        old = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        keep = [p for p in old if p != str(libdir)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libdir)] + keep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the pip-installed perf_analyzer: libcudart.so.12 from the
    nvidia-cuda-runtime-cu12 wheel on LD_LIBRARY_PATH (libb64.so.0d comes from Debian's libb64-0d).
    """
    env = dict(os.environ if base is None else base)
    spec = importlib.util.find_spec("nvidia")
    libs = []
    if spec is not None and spec.submodule_search_locations:
        libs = [str(Path(p) / "cuda_runtime" / "lib") for p in spec.submodule_search_locations]
    old = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + old)
    return env


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (held together while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def server_argv(
    paths: TritonPaths,
    model_repository: str | os.PathLike[str],
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    host: str = "0.0.0.0",
    model_control_mode: str | None = None,
    load_models: Sequence[str] = (),
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The tritonserver command line (list of str) for the given repository and ports."""
    argv = [
        str(paths.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={paths.backends_dir}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--http-address={host}",
        f"--grpc-address={host}",
        f"--metrics-address={host}",
    ]
    if model_control_mode:
        argv.append(f"--model-control-mode={model_control_mode}")
    argv += [f"--load-model={m}" for m in load_models]
    return argv + list(extra_args)


class TritonServer:
    """A tritonserver process for tests and the demo.

    Usage:
        with TritonServer("model_repository") as server:
            requests.post(f"{server.http_url}/v2/models/m/generate", ...)

    Args:
        model_repository: folder of model folders.
        http_port, grpc_port, metrics_port: ports; None picks free ones.
        model_control_mode: "none" (default of tritonserver), "explicit" or "poll".
        load_models: `--load-model` names (explicit mode).
        extra_args: further tritonserver flags.
        host: bind address (loopback by default).
        log_path: server log file; default a new file in a temp folder, removed with this object
            (or at exit) unless the server failed to start or died, the `with` block raised, or
            `MLA_KEEP_SERVER_LOGS` is set.
        startup_timeout: seconds to wait for readiness (s).
        wait_models: models that must be READY before start() returns; None means every model
            the repository index lists (an UNAVAILABLE one raises).
        env: extra environment variables for the server.
    Raises (from start / __enter__):
        TritonServerError: the server died or was not ready within `startup_timeout`; the message
            holds the tail of the log.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        model_control_mode: str | None = None,
        load_models: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 180.0,
        wait_models: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_repository = Path(model_repository)
        self.host = host
        self._fixed_ports = (http_port, grpc_port, metrics_port)
        self._pick_ports()
        self.model_control_mode = model_control_mode
        self.load_models = tuple(load_models)
        self.extra_args = tuple(extra_args)
        self._log_cleanup: weakref.finalize | None = None
        if log_path is None:
            log_dir = tempfile.mkdtemp(prefix="tritonserver-")
            log_path = Path(log_dir) / "server.log"
            if not os.environ.get("MLA_KEEP_SERVER_LOGS"):
                self._log_cleanup = weakref.finalize(self, shutil.rmtree, log_dir, True)
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.wait_models = None if wait_models is None else tuple(wait_models)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def _pick_ports(self) -> None:
        ports = free_ports(3, self.host)
        self.http_port, self.grpc_port, self.metrics_port = (
            fixed or free for fixed, free in zip(self._fixed_ports, ports)
        )

    # -- urls -------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """`http://host:port` (no trailing slash)."""
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port`, the form tritonclient.grpc expects."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """`http://host:port/metrics` (Prometheus text)."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> TritonServer:
        """Start the server and wait until it and its models are ready. When a free port picked
        here was taken by someone else meanwhile, retries on new ports (`attempts` in all); the
        log of such a failed attempt N is kept beside `log_path` as `<name>.attemptN`."""
        for attempt in range(attempts):
            try:
                return self._start()
            except TritonServerError as e:
                clash = "already in use" in str(e) and None in self._fixed_ports
                if not clash or attempt == attempts - 1:
                    self.keep_log()
                    raise
                # Triton loads its models before it binds its ports, so the failed attempt's
                # log already has load lines: move it aside, and `log_path` holds this server's.
                self.log_path.replace(self.log_path.with_name(
                    f"{self.log_path.name}.attempt{attempt + 1}"))
                self.proc = None
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start(self) -> TritonServer:
        if self.proc is not None:
            raise TritonServerError("server already started")
        paths = find_tritonserver()
        prepare_stub(paths)
        argv = server_argv(
            paths, self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
            host=self.host, model_control_mode=self.model_control_mode,
            load_models=self.load_models, extra_args=self.extra_args,
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_env()
        env.update(self.extra_env)
        with open(self.log_path, "ab") as log:
            # Own process group: stop() can reach the backend stubs too.
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )
        try:
            self.wait_ready(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """Last `lines` lines of the server log, after its first error-level lines (Triton
        writes a model's load error, with the Python exception, on one line starting `E<mmdd>`;
        a long status table can push it out of the tail)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        all_lines = text.splitlines()
        tail = all_lines[-lines:]
        errors = [line[:3000] for line in all_lines[:-lines] if _ERROR_LINE.match(line)][:5]
        head = ["error lines:", *errors, "...", "last lines:"] if errors else []
        return "\n".join(head + tail)

    def check_alive(self) -> None:
        """Raise TritonServerError (with the log tail) if the server process has exited."""
        if self.proc is None:
            raise TritonServerError("server not started")
        rc = self.proc.poll()
        if rc is not None:
            self.keep_log()
            raise TritonServerError(
                f"tritonserver exited with code {rc}; log {self.log_path}, last lines:\n"
                + self.log_tail()
            )

    def _request(
        self, path: str, body: dict | None = None, timeout: float = 5.0
    ) -> tuple[int, bytes]:
        """GET (body None) or POST JSON to the HTTP endpoint; returns (status, body bytes)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.http_url + path, data=data)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def model_states(self) -> dict[str, tuple[str, str]]:
        """name -> (state, reason) from the repository index (POST v2/repository/index)."""
        status, body = self._request("/v2/repository/index", {})
        if status != 200:
            raise TritonServerError(f"repository index: HTTP {status}: {body[:200]!r}")
        return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in json.loads(body)}

    def wait_ready(self, timeout: float) -> None:
        """Poll until v2/health/ready is 200, the awaited models are READY and the metrics port
        answers (tritonserver starts its metrics service after the HTTP one: a client that
        reads metrics right after readiness could otherwise find the port closed).

        Raises:
            TritonServerError: the process died, a model is UNAVAILABLE, or `timeout` (s) passed.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                status, _ = self._request("/v2/health/ready", timeout=2.0)
                if status == 200 and self._models_ready() and self._metrics_up():
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready after {timeout:.0f} s; log {self.log_path}, "
                    "last lines:\n" + self.log_tail()
                )
            time.sleep(0.25)

    def _metrics_up(self) -> bool:
        """The metrics endpoint answers 200 (raises URLError / OSError while it is closed)."""
        with urllib.request.urlopen(self.metrics_url, timeout=2.0) as r:
            return r.status == 200

    def _models_ready(self) -> bool:
        states = self.model_states()
        names = self.wait_models if self.wait_models is not None else tuple(states)
        for name in names:
            state, reason = states.get(name, ("", ""))
            if state == "UNAVAILABLE":
                raise TritonServerError(
                    f"model {name!r} failed to load: {reason}\nlog {self.log_path}, last lines:\n"
                    + self.log_tail()
                )
            if self.wait_models is None and state == "":
                continue  # listed but not loaded (explicit mode): nothing to wait for
            if state != "READY":
                return False
        return True

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (tritonserver unloads models and exits), then SIGKILL to the process group
        after `timeout` seconds. Returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._stopping = True
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.proc.wait(10)
        # Backend stubs left behind by a killed server belong to our process group.
        self._kill_group()
        return self.proc.returncode

    def keep_log(self) -> None:
        """Keep the default log folder after this object is gone (failures call this)."""
        if self._log_cleanup is not None:
            self._log_cleanup.detach()

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        died = self.proc is not None and self.proc.poll() is not None and not self._stopping
        rc = self.stop()
        if died or exc_type is not None:  # a failure inside the session keeps the log too
            self.keep_log()
        if died and exc_type is None:
            raise TritonServerError(
                f"tritonserver died during the session (exit code {rc}); log {self.log_path}, "
                "last lines:\n" + self.log_tail()
            )


# -- command line -----------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    paths = find_tritonserver()
    prepare_stub(paths)
    argv = server_argv(
        paths, args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
        host=args.host, model_control_mode=args.model_control_mode,
        load_models=args.load_model, extra_args=args.extra,
    )
    sys.stdout.flush()
    os.execve(str(paths.binary), argv, server_env())
    return 0  # not reached


def _stream_http(server: TritonServer, model: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({
        "text_input": prompt, "stream": True, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0}),
    })
    url = f"{server.http_url}/v2/models/{model}/generate_stream"
    print("$ " + shlex.join(["curl", "-sN", "-X", "POST", url, "-d", body]), flush=True)
    subprocess.run(["curl", "-sN", "--max-time", "300", "-X", "POST", url, "-d", body], check=True)
    print(flush=True)


def _demo(args: argparse.Namespace) -> int:
    repo = Path(args.model_repository)
    models = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    if not models:
        raise TritonServerError(f"no models (folders with config.pbtxt) in {repo}")
    client = REPO_ROOT / "client_examples" / "grpc_stream.py"
    with TritonServer(repo, startup_timeout=args.timeout) as server:
        print(f"tritonserver ready: http {server.http_url}, grpc {server.grpc_url}, "
              f"log {server.log_path}", flush=True)
        for model in models:
            print(f"\n=== {model} ===", flush=True)
            prompt = args.prompt or DEMO_PROMPTS.get(model, DEFAULT_PROMPT)
            if client.is_file():
                cmd = [sys.executable, str(client), "--url", server.grpc_url, "--model", model,
                       "--prompt", prompt, "--max-tokens", str(args.max_tokens)]
                weights = repo / model / "weights"
                if (weights / "chat_template.jinja").is_file():  # an instruct model: its template
                    cmd += ["--chat", str(weights)]
                print("$ python " + shlex.join([os.path.relpath(client)] + cmd[2:]), flush=True)
                subprocess.run(cmd, check=True, timeout=300)
            else:
                _stream_http(server, model, prompt, args.max_tokens)
            server.check_alive()
    print("\nserver stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_tools.tritonserver")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="print where tritonserver is and check the Python-backend stub")
    serve = sub.add_parser("serve", help="exec tritonserver in the foreground")
    serve.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--host", default="0.0.0.0", help="bind address of all three endpoints")
    serve.add_argument("--model-control-mode", default=None)
    serve.add_argument("--load-model", action="append", default=[])
    serve.add_argument("extra", nargs=argparse.REMAINDER, help="-- then more tritonserver flags")
    demo = sub.add_parser("demo", help="start a server on free ports, stream a prompt per model")
    demo.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    demo.add_argument("--prompt", default=None,
                      help="one prompt for every model (default: DEMO_PROMPTS, else DEFAULT_PROMPT)")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--timeout", type=float, default=300.0, help="start-up timeout (s)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "info":
            paths = find_tritonserver()
            stub = prepare_stub(paths)
            print(f"tritonserver: {paths.binary}\nbackends:     {paths.backends_dir}\n"
                  f"python stub:  {stub} (Python {sys.version_info.major}."
                  f"{sys.version_info.minor}, libraries OK)")
            return 0
        if args.cmd == "serve":
            if args.extra and args.extra[0] == "--":
                args.extra = args.extra[1:]
            return _serve(args)
        return _demo(args)
    except TritonServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
