# Sourced by gpu_env.sh and gpu_server_path.sh on the GPU machine. mla_extra_path DIR prints the
# PYTHONPATH entries for structured outputs from a bundle unpacked at DIR: DIR/extra/xgrammar,
# then DIR/extra/pydantic and DIR/extra/jsonschema only where the machine's python3 lacks them.
mla_extra_path() {
  local extra="$1/extra/xgrammar" pkg
  for pkg in pydantic jsonschema; do
    python3 -c "import $pkg" 2>/dev/null || extra="$extra:$1/extra/$pkg"
  done
  echo "$extra"
}
