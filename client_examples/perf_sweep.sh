#!/usr/bin/env bash
# perf_analyzer concurrency sweep over gRPC streaming: the exact run CI makes
# (tests/serving/test_triton_e2e.py::test_perf_analyzer_concurrency_sweep) against a running server.
#
#   client_examples/perf_sweep.sh [MODEL [GRPC_URL [OUT_DIR]]] [extra perf_analyzer flags...]
#
# Defaults: MODEL deepseek-v2-tiny, GRPC_URL localhost:8001, OUT_DIR ./perf_out. Input:
# client_examples/perf_input.json (two prompts, 32 tokens each, one greedy, one seeded sampling).
# Concurrency 1, 3, 5, 7; each level is measured over 3 windows of at least 4 requests
# (count_windows, --max-trials 3). --stability-percentage 1000 turns the stability gate off: when a
# level does not stabilize, perf_analyzer stops the sweep early yet exits 0, so CI would see missing
# rows instead of numbers; this run checks that every request succeeds, and its numbers are rough.
# For steady numbers use e.g. `--stability-percentage 10 --measurement-request-count 32
# --max-trials 10` (later flags override earlier ones).
#
# Writes OUT_DIR/perf.csv (one row per concurrency) and OUT_DIR/profile.json (each request's
# inputs, response timestamps and text outputs). perf_analyzer exits non-zero on the first error
# response. It needs libcudart.so.12 (the nvidia-cuda-runtime-cu12 wheel; found through `python3`
# on PATH, e.g. the venv's) and libb64.so.0d (Debian package libb64-0d), even on a CPU machine.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL="${1:-deepseek-v2-tiny}"
URL="${2:-localhost:8001}"
OUT="${3:-perf_out}"
shift $(($# < 3 ? $# : 3))

PYTHON="${PYTHON:-python3}"
cudart="$("$PYTHON" -c 'import os, nvidia.cuda_runtime as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)"
if [[ -n "$cudart" ]]; then
  export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

mkdir -p "$OUT"
set -x
perf_analyzer -m "$MODEL" -u "$URL" -i grpc --async --streaming \
  --input-data "$HERE/perf_input.json" \
  --concurrency-range 1:8:2 \
  --measurement-mode count_windows --measurement-request-count 4 --max-trials 3 \
  --stability-percentage 1000 \
  -f "$OUT/perf.csv" --profile-export-file "$OUT/profile.json" \
  "$@"
