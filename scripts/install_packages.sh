# Sourced by setup.sh and setup_vllm.sh: `install_packages VENV PACKAGE...` (pip's arguments: specs, -e, -r).
# uv resolves, downloads and unpacks in parallel: artrl's dependencies in ~10 s where pip took ~45 s, vLLM's in
# ~16 s where pip took ~40 s (2-core Xeon, the same versions installed). uv does not read pip's configuration
# (a mirror in pip.conf, find-links), so where it fails pip installs the same, as before. Neither compiles
# bytecode here: the scripts run compileall on every core afterwards.
install_packages() {
  local venv=$1
  shift
  "$venv/bin/python" -m pip install -q uv 2>&1 | grep -v '^WARNING: Location' || true
  if [ -x "$venv/bin/uv" ] && "$venv/bin/uv" pip install -q --python "$venv/bin/python" "$@"; then
    return 0
  fi
  echo "uv could not install these; pip instead ..." >&2
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -m pip install -q --no-compile "$@" 2>&1 | grep -v '^WARNING: Location' || true
}
