# Sourced on the GPU machine, in the repository root, with .gpu/bundle.tar.xz carried
# (made here by benchmarks/gpu_bundle.sh):
#
#   source benchmarks/gpu_env.sh
#
# Unpacks the bundle to $MLA_GPU_DIR (default /tmp/mla_gpu) and makes the environment the
# Python-backend stub needs: a venv of the machine's python3 whose own site-packages hold numpy
# 1.26.4 and tritonclient, ahead of the machine's packages (torch, transformers, ...; added by a
# .pth file, less those that need numpy 2: benchmarks/gpu_stub_site.py) and this repository
# (the stub does not read PYTHONPATH; it uses the site-packages of the `python3` first on
# PATH). Then: that venv's bin first on PATH, MLA_TRITONSERVER_ROOT for mla_tools.tritonserver,
# perf_analyzer on PATH (a wrapper that gives it libcudart.so.12 and libb64),
# MLA_DEEPSEEK_TOKENIZER_DIR for the V2-Lite-shaped models.
MLA_GPU_DIR="${MLA_GPU_DIR:-/tmp/mla_gpu}"
# the machine's own python3 (numpy 2), before the stub's venv goes first on PATH (genai-perf)
export MLA_MACHINE_PYTHON="${MLA_MACHINE_PYTHON:-$(command -v python3)}"
if [[ ! -x "$MLA_GPU_DIR/venv/bin/python" ]]; then
  mkdir -p "$MLA_GPU_DIR"
  tar -xJf .gpu/bundle.tar.xz -C "$MLA_GPU_DIR"
  image_site="$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  python3 -m venv --without-pip "$MLA_GPU_DIR/venv"
  venv_site="$("$MLA_GPU_DIR/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  cp -a "$MLA_GPU_DIR/site/." "$venv_site/"
  echo "$PWD" >"$venv_site/mla_backend_repo.pth"
  # the machine's packages minus those that need numpy 2 (the stub's numpy is 1.26.4)
  numpy_version="$(cd "$MLA_GPU_DIR/site" && python3 -c 'import importlib.metadata as m; print(m.version("numpy"))')"
  python3 benchmarks/gpu_stub_site.py "$image_site" "$MLA_GPU_DIR/image_site" "$numpy_version"
  echo "import site; site.addsitedir('$MLA_GPU_DIR/image_site')" >"$venv_site/zz_machine_site.pth"
  # structured outputs (xgrammar), after the machine's packages; pydantic and jsonschema only
  # where it lacks them
  source benchmarks/gpu_extra_path.sh
  extra="$(mla_extra_path "$MLA_GPU_DIR")"
  echo "$extra" >"$MLA_GPU_DIR/extra_path"
  # ahead of the machine's packages: pydantic needs a newer typing_extensions than some images have
  echo "import sys; sys.path[:0] = '$extra'.split(':')" >"$venv_site/zzz_structured_outputs.pth"
  mkdir -p "$MLA_GPU_DIR/libexec"
  mv "$MLA_GPU_DIR/bin/perf_analyzer" "$MLA_GPU_DIR/libexec/perf_analyzer"
  cat >"$MLA_GPU_DIR/bin/perf_analyzer" <<EOF
#!/usr/bin/env bash
LD_LIBRARY_PATH="$MLA_GPU_DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$MLA_GPU_DIR/libexec/perf_analyzer" "\$@"
EOF
  chmod +x "$MLA_GPU_DIR/bin/perf_analyzer"
fi
export MLA_TRITONSERVER_ROOT="$MLA_GPU_DIR/pytriton/tritonserver"
export PATH="$MLA_GPU_DIR/venv/bin:$MLA_GPU_DIR/bin:$PATH"
export MLA_DEEPSEEK_TOKENIZER_DIR="$MLA_GPU_DIR/tokenizer"
export PYTHONPATH="$PWD:$(cat "$MLA_GPU_DIR/extra_path")${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
python3 -c 'import importlib.metadata as m, numpy, torch, tritonclient.grpc; print("stub env: numpy", numpy.__version__, "torch", torch.__version__)' &&
  { python3 -c 'import xgrammar' || echo "gpu_env.sh: no structured outputs here (xgrammar does not import)" >&2; }
