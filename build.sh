#!/usr/bin/env bash
# mla_backend: set-up, serve, demo, test, docker.
#
#   ./build.sh setup    venv in .venv (genai-perf in .venv-genai-perf), Python deps, system
#                       libraries, model weights (idempotent; cached by stamps keyed on the
#                       dependency lists: a second run takes seconds)
#   ./build.sh serve    setup if needed, then tritonserver in the foreground over model_repository/
#                       (ports 8000/8001/8002; env HTTP_PORT, GRPC_PORT, METRICS_PORT override)
#   ./build.sh demo     start a server on free ports, stream one prompt to each model, stop it
#   ./build.sh test     setup if needed, then `python -m pytest -q` (extra args go to pytest)
#   ./build.sh docker   docker build -t mla-backend -f docker/Dockerfile .
#
# Environment: PYTHON (interpreter for the venv, default python3), TORCH_SPEC (pip spec for torch;
# default torch==2.13.0 on a machine without an NVIDIA GPU, else the default CUDA build of torch).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.mla_setup_stamp"
SETUP_VERSION=1 # bump to force every checkout to redo the pip steps
MODEL_REPOSITORY="$ROOT/model_repository"

log() { printf '[build.sh] %s\n' "$*" >&2; }
die() {
  printf '[build.sh] error: %s\n' "$*" >&2
  exit 1
}

torch_spec() {
  if [[ -n "${TORCH_SPEC:-}" ]]; then
    echo "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "torch" # PyPI's Linux wheel is the CUDA build
  else
    echo "torch==2.13.0" # CPU build (from the local wheel folder on the project's machines)
  fi
}

# triton-language kernels: the CUDA build of torch brings its own triton; with the CPU build we add
# it (its interpreter, TRITON_INTERPRET=1, runs the kernel tests on the CPU).
triton_spec() {
  case "$(torch_spec)" in
    torch==2.13.0) echo "triton==3.6.0" ;;
    *) echo "" ;;
  esac
}

setup_key() {
  {
    echo "v$SETUP_VERSION"
    torch_spec
    triton_spec
    "$PY" -c 'import sys; print(sys.version)'
    cat requirements.txt requirements-nodeps.txt pyproject.toml # its packages: pip install -e .
  } | sha256sum | cut -d' ' -f1
}

have_lib() { /sbin/ldconfig -p 2>/dev/null | grep -qF "$1 "; }

# Debian libraries: libpythonX.Y (the Python-backend stub embeds it; only for a Python without its
# own shared libpython) and libb64-0d (perf_analyzer).
ensure_system_libs() {
  local pyver need=()
  pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  # A shared-library Python (pyenv's) brings its own libpython: the server is pointed at it.
  local shared='import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_ENABLE_SHARED"))'
  if ! "$PY" -c "$shared"; then
    have_lib "libpython$pyver.so.1.0" || need+=("libpython$pyver")
  fi
  have_lib "libb64.so.0d" || need+=("libb64-0d")
  [[ ${#need[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need[@]}" >/dev/null
  else
    log "warning: missing Debian packages ${need[*]} (not root or no apt-get): install them;" \
      "libpython$pyver is needed to serve, libb64-0d for perf_analyzer"
  fi
}

pip_install() {
  local key="$1" spec
  spec="$(torch_spec)"
  log "pip install $spec and requirements (first run: a few minutes)"
  "$PY" -m pip install -q "$spec" $(triton_spec)
  "$PY" -m pip install -q -r requirements.txt
  "$PY" -m pip install -q --no-deps -r requirements-nodeps.txt
  "$PY" -m pip install -q --no-deps -e .
  echo "$key" >"$STAMP"
}

# genai-perf in a venv of its own (requirements-genai-perf.txt says why), with its own stamp.
GENAI_VENV="$ROOT/.venv-genai-perf"
genai_perf_setup() {
  local key stamp="$GENAI_VENV/.mla_setup_stamp"
  key="$({ "$PY" -c 'import sys; print(sys.version)'; cat requirements-genai-perf.txt; } |
    sha256sum | cut -d' ' -f1)"
  [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]] && return 0
  log "pip install genai-perf into $GENAI_VENV"
  [[ -x "$GENAI_VENV/bin/python" ]] || "$PY" -m venv "$GENAI_VENV"
  "$GENAI_VENV/bin/python" -m pip install -q -r requirements-genai-perf.txt
  echo "$key" >"$stamp"
}

cmd_setup() {
  # One set-up at a time per checkout (tests and serve may start together).
  exec 9>"/tmp/mla_backend-setup-$(echo "$ROOT" | sha256sum | cut -c1-12).lock"
  flock 9
  if [[ ! -x "$PY" ]]; then
    local python="${PYTHON:-python3}"
    command -v "$python" >/dev/null || die "$python not found (set PYTHON to a Python >= 3.10)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
      die "$python is older than 3.10"
    log "creating venv $VENV with $("$python" --version)"
    "$python" -m venv "$VENV"
  fi
  local key
  key="$(setup_key)"
  if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$key" ]]; then
    pip_install "$key"
  fi
  genai_perf_setup
  ensure_system_libs
  # Copies the Python-backend stub for the venv's Python and checks its libraries (clear error).
  "$PY" -m mla_tools.tritonserver info >/dev/null
  "$PY" -m mla_tools.prepare --model-repository "$MODEL_REPOSITORY"
  flock -u 9
}

models() {
  local d
  for d in "$MODEL_REPOSITORY"/*/; do
    [[ -f "$d/config.pbtxt" ]] && basename "$d"
  done
  return 0
}

cmd_serve() {
  cmd_setup
  local http="${HTTP_PORT:-8000}" grpc="${GRPC_PORT:-8001}" metrics="${METRICS_PORT:-8002}"
  local model
  model=smollm2-135m-instruct # the instruct model answers the example question (in its template)
  [[ -f "$MODEL_REPOSITORY/$model/config.pbtxt" ]] || model="$(models | head -n1)"
  cat >&2 <<EOF

[build.sh] starting tritonserver: HTTP :$http, gRPC :$grpc, metrics :$metrics (Ctrl-C stops it)
[build.sh] models: $(models | tr '\n' ' ')
[build.sh] stream a prompt over HTTP (server-sent events, one text delta per event):
  curl -sN -X POST localhost:$http/v2/models/$model/generate_stream \\
    -d '{"text_input": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", "stream": true, "max_tokens": 64, "temperature": 0}'
EOF
  if [[ -f client_examples/grpc_stream.py ]]; then
    cat >&2 <<EOF
[build.sh] or over gRPC streaming (tritonclient):
  .venv/bin/python client_examples/grpc_stream.py --url localhost:$grpc --model $model \\
    --chat model_repository/$model/weights --prompt "What is the capital of France?"
EOF
  fi
  echo >&2
  exec "$PY" -m mla_tools.tritonserver serve --model-repository "$MODEL_REPOSITORY" \
    --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics"
}

cmd_demo() {
  cmd_setup
  exec "$PY" -m mla_tools.tritonserver demo --model-repository "$MODEL_REPOSITORY" "$@"
}

cmd_test() {
  cmd_setup
  # The venv's bin first: tests find perf_analyzer and the server finds the venv's python3 there.
  export PATH="$VENV/bin:$PATH"
  exec "$PY" -m pytest -q "$@"
}

cmd_docker() {
  command -v docker >/dev/null 2>&1 || die "docker not found"
  exec docker build -t mla-backend -f docker/Dockerfile "$@" .
}

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit "${1:-0}"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  setup) cmd_setup ;;
  serve) cmd_serve ;;
  demo) cmd_demo "$@" ;;
  test) cmd_test "$@" ;;
  docker) cmd_docker "$@" ;;
  -h | --help | help) usage 0 ;;
  *) usage 2 ;;
esac
