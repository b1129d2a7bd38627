# Sourced by setup.sh and setup_vllm.sh: `install_packages VENV PACKAGE...` (pip's arguments: specs, -e, -r,
# --find-links). uv resolves, downloads and unpacks in parallel: artrl's dependencies in ~10 s where pip took
# ~45 s, vLLM's in ~16 s where pip took ~40 s, torch's 190 MB wheel from this machine's disk in ~6 s where pip
# took ~12 s (2-core Xeon, the same versions installed). uv does not read pip's configuration, so
# `pip_find_links` passes on pip's find-links (where this kind of machine keeps torch's CPU build); where uv
# fails, pip installs the same, as before. Neither compiles bytecode here (see setup.sh).
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

# `--find-links DIR` for each folder or page in pip's configuration (PIP_FIND_LINKS, or pip.conf's global or
# install section, as VENV's pip reads them), one argument a line, for uv: `pip_find_links VENV`
pip_find_links() {
  local links link
  links=${PIP_FIND_LINKS:-$("$1/bin/python" -m pip config get global.find-links 2>/dev/null \
    || "$1/bin/python" -m pip config get install.find-links 2>/dev/null || true)}
  read -r -a links <<<"$links"
  for link in ${links[@]+"${links[@]}"}; do
    printf -- '--find-links\n%s\n' "$link"
  done
}
