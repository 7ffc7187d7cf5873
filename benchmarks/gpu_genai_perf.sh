#!/usr/bin/env bash
# Packs what the GPU machine lacks to run genai-perf 0.0.16 (beyond its image's pandas, numpy 2,
# transformers, rich, ...) into the git-ignored .gp/ (~14 MB of Python 3.12 wheels: genai-perf,
# orjson, soundfile with cffi and pycparser, plotly), carried in a device call of its own on the
# warm machine (the server bundle and the working tree fill one call), for
# `benchmarks/gpu_server_path.sh genai`. Run here:
#
#   benchmarks/gpu_genai_perf.sh
#
# genai-perf runs there with the machine's own python3 (numpy 2), never in the stub's venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
GPU_PY="${MLA_GPU_PY:-3.12}"
grep -qx '/.gp/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gp/' >>.git/info/exclude; }
rm -rf .gp && mkdir -p .gp
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gp \
  genai-perf==0.0.16 orjson==3.13.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 plotly==7.1.0
du -sh .gp >&2
