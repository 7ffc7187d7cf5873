#!/usr/bin/env bash
# Verify the optional flashinfer attention backend on a CUDA machine (written for the lent H200:
# python 3.12, torch 2.11 CUDA 13.0 build, nvcc 13, ninja, 16 cores, no network).
#
# Assumes the ignored folder .whl/ travelled with the tree (device tool: carry [".whl"]):
#   flashinfer_python-0.7.2.post1+mlatrim-py3-none-any.whl   flashinfer-python 0.7.2.post1 repacked
#       without what its FA2 attention JIT does not use (moe_ep, most of experimental, cutlass,
#       csrc sub-folders, prebuilt-kernel dirs); python package, include/, top-level csrc, cccl.
#   apache_tvm_ffi-0.1.15.post2-cp312-...whl                  its runtime/JIT dependency.
# Steps: install both into /tmp/site (no index, no deps: every other dependency is already on the
# machine); point flashinfer's JIT cache at /tmp/fi_jit and its arch list at 9.0 only; when
# $CUDA_HOME/lib64 lacks libcudart.so (pip-installed CUDA keeps lib/libcudart.so.13) give the
# linker a folder with libcudart.so / libcuda.so links; build the FA2 modules the tests use, all at
# once, printing each build time; then run the GPU tests
#   python3 -m pytest -q -s -m gpu tests/layers/test_flashinfer_backend.py
# Modules compiled (bf16, int32 indices, sm_90a), four in all:
#   batch_prefill ... head_dim_qk_128_head_dim_vo_128 ... kv_stride_equal   (GQA/MHA/MQA decode on
#       tensor cores and extend; 4 paged + 4 ragged mask kernels + 2 host files)
#   batch_prefill ... head_dim_qk_192_head_dim_vo_128 ... kv_stride_equal   (decompressed MLA
#       prefill, ragged; same 10 files)
#   batch_prefill ... 192/128 ... paged_kv_stride_independent (DeepSeek MHA pool: K, V strides
#       differ; 4 paged kernels + 2 host files)
#   batch_mla_attention ... ckv_512_kpe_64 (absorbed MLA decode/extend; 3 files)
# On a 2-core CPU with nvcc 13.0 the MLA module built in 40 s and the 128/128 one in 173 s; with
# MAX_JOBS=16 the whole script is expected to take 3-5 minutes (limit: 480 s).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
elapsed() { echo "[flashinfer_device_check] $1 at +$(( $(date +%s) - T0 )) s"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# JIT cache: /tmp/fi_jit/.cache/flashinfer/<version>/<arch>
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_jit
export FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
elapsed "installed"

if [ -z "${CUDA_HOME:-}" ]; then
    NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
fi
echo "CUDA_HOME=$CUDA_HOME"; "$CUDA_HOME/bin/nvcc" --version | tail -2
c++ --version | head -1 || true
if [ ! -e "$CUDA_HOME/lib64/libcudart.so" ]; then  # flashinfer links -L$CUDA_HOME/lib64 -lcudart
    mkdir -p /tmp/fi_lib
    CUDART=$(ls "$CUDA_HOME"/lib*/libcudart.so* 2>/dev/null | head -1 || true)
    if [ -z "$CUDART" ]; then  # pip-installed CUDA runtime: site-packages/nvidia/cu13/lib
        CUDART=$(python3 -c 'import glob, site
hits = [g for p in site.getsitepackages() for g in glob.glob(p + "/nvidia/cu*/lib/libcudart.so*")]
print(hits[0] if hits else "")')
    fi
    LIBCUDA=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
    ln -sf "$CUDART" /tmp/fi_lib/libcudart.so
    ln -sf "$LIBCUDA" /tmp/fi_lib/libcuda.so
    export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/fi_lib"
    echo "link shim: libcudart.so -> $CUDART, libcuda.so -> $LIBCUDA"
fi

python3 - <<'EOF'
import time
from concurrent.futures import ThreadPoolExecutor

import flashinfer
import torch
from flashinfer.jit.attention.modules import (
    _gen_batch_prefill_independent_paged_module,
    _gen_batch_prefill_primary_module,
    gen_batch_mla_module,
)

assert torch.cuda.is_available(), "no CUDA device"
print("flashinfer", flashinfer.__version__, "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(), flush=True)
bf, i32 = torch.bfloat16, torch.int32
specs = [
    _gen_batch_prefill_primary_module("fa2", bf, bf, bf, i32, 128, 128, 0, False, False, False),
    _gen_batch_prefill_primary_module("fa2", bf, bf, bf, i32, 192, 128, 0, False, False, False),
    _gen_batch_prefill_independent_paged_module("fa2", bf, bf, bf, i32, 192, 128, 0, False,
                                                False, False),
    gen_batch_mla_module("fa2", bf, bf, bf, i32, 512, 64, False),
]


def build(spec):
    t = time.time()
    spec.build()
    return spec.name, time.time() - t


t0 = time.time()
with ThreadPoolExecutor(len(specs)) as pool:
    for name, seconds in pool.map(build, specs):
        print(f"built {name} in {seconds:.0f} s", flush=True)
print(f"all flashinfer modules built in {time.time() - t0:.0f} s", flush=True)
EOF
elapsed "JIT modules built"

python3 -m pytest -q -s -m gpu tests/layers/test_flashinfer_backend.py -rs --durations=0 \
    -p no:cacheprovider
elapsed "done"
