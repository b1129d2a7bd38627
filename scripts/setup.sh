#!/usr/bin/env bash
# Creates .venv with everything artrl needs (idempotent: re-runs only when pyproject.toml changed).
# torch is pinned to the CPU build that this kind of machine has on disk; on a GPU machine set
# ARTRL_TORCH="torch==<version>" (or pre-install torch in .venv) to take a CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${ARTRL_TORCH:-torch==2.13.0}
stamp=.venv/.artrl-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
previous_stamp=.venv/sdk-previous/.installed
previous_want=$(sha256sum tests/sdk_previous.txt | cut -d' ' -f1)
install_previous_sdks() {  # the older SDK majors the tests drive too (tests/sdk_previous.txt)
  if [ ! -f "$previous_stamp" ] || [ "$(cat "$previous_stamp")" != "$previous_want" ]; then
    rm -rf .venv/sdk-previous
    .venv/bin/python -m pip install -q --no-compile --no-deps --target .venv/sdk-previous -r tests/sdk_previous.txt \
      2>&1 | grep -v '^WARNING: Location' || true
    PYTHONPATH=.venv/sdk-previous .venv/bin/python -c "import openai, anthropic"  # fail loudly if missing
    echo "$previous_want" > "$previous_stamp"
  fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  install_previous_sdks
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
source scripts/install_packages.sh
# (torch through pip: pip's configuration is what finds the CPU build on this kind of machine's disk)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "installing $TORCH_SPEC ..."
  .venv/bin/python -m pip install -q --no-compile "$TORCH_SPEC" 2>&1 | grep -v '^WARNING: Location' || true
fi
echo "installing artrl and its dependencies ..."
install_packages .venv -e ".[local,dev,examples,mcp,trackers,tinker]"
# bytecode compiled on every core (pip compiles one file at a time: ~45 s more here); without it, a machine
# with PYTHONDONTWRITEBYTECODE set would compile torch's modules again at every import
.venv/bin/python -m compileall -qq -j 0 .venv/lib >/dev/null 2>&1 || true  # (a few packages ship files that do not compile)
.venv/bin/python -c "import torch, transformers, fastapi, mcp, artrl" # fail loudly if anything is missing
install_previous_sdks
echo "$want" > "$stamp"
