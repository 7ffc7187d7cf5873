#!/usr/bin/env bash
# The product path on the GPU machine (issue 41): tritonserver, the stub, our model and its engine
# process on CUDA. One step per device call (each fits its 10-minute limit):
#
#   bash benchmarks/gpu_server_path.sh tests   # the gpu+e2e tests through tritonserver
#   bash benchmarks/gpu_server_path.sh bf16    # bench_server_path.py, V2-Lite shape: peak + sweep
#   bash benchmarks/gpu_server_path.sh fp8     # the FP8 weights + FP8 cache peak, merged in
#
# Arguments after the step go to bench_server_path.py (e.g. --num-requests 3000).
#
# Run in the repository root with .gpu/ carried (benchmarks/gpu_bundle.sh makes it) and
# MLA_COMMIT set to the commit under test (the machine's copy has no git history). Logs and the
# JSON results go to $OUT (the device tool's folder) or /tmp/mla_out; copy h200_server_path.json
# from there to benchmarks/results/ (fp8 run on its own: merge its "fp8" key by hand).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmarks/gpu_env.sh || exit 1
out="${OUT:-/tmp/mla_out}"
mkdir -p "$out"
commit="${MLA_COMMIT:-unknown}"
json_name=h200_server_path.json  # written after each phase into $out; (fp8) merged into one there
export PYTHONUNBUFFERED=1
case "${1:-}" in
  tests)
    # what the stub imports, as the stub sees it (no PYTHONPATH)
    (unset PYTHONPATH; cd /tmp && python3 -c 'import mla_backend.client, mla_backend.engine, xgrammar; from transformers import AutoTokenizer; print("stub imports: ok")') \
      >"$out/stub_import.log" 2>&1
    tail -40 "$out/stub_import.log"
    grep -q "stub imports: ok" "$out/stub_import.log" || exit 3
    python3 -m mla_tools.prepare --models deepseek-v2-tiny
    # the cut V2-Lite shape takes DeepSeek-V3's tokenizer
    MLA_KEEP_SERVER_LOGS=1 MLA_TEST_TOKENIZER_DIR="$MLA_DEEPSEEK_TOKENIZER_DIR" python3 -m pytest -q -p no:cacheprovider \
      -m "gpu and e2e" tests/serving/test_gpu_e2e.py 2>&1 | tee "$out/gpu_e2e.log"
    for log in /tmp/tritonserver-*/server.log; do  # (the first few servers' logs)
      [[ -f "$log" ]] && cp "$log" "$out/server-$(basename "$(dirname "$log")").log"
    done
    ;;
  bf16)
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --json "$out/$json_name" --details "$out/bf16_details.json" "${@:2}" 2>&1 | tee "$out/bf16.log"
    ;;
  fp8)
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --quantization fp8 --kv-cache-dtype fp8_e4m3 --concurrency --merge \
      --json "$out/$json_name" --details "$out/fp8_details.json" "${@:2}" 2>&1 | tee "$out/fp8.log"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_server_path.sh tests|bf16|fp8" >&2
    exit 2
    ;;
esac
