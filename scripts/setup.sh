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
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "installing $TORCH_SPEC ..."
  mapfile -t find_links < <(pip_find_links .venv)  # (where pip finds the CPU build on this kind of machine's disk)
  install_packages .venv ${find_links[@]+"${find_links[@]}"} "$TORCH_SPEC"
fi
echo "installing artrl and its dependencies ..."
install_packages .venv -e ".[local,dev,examples,mcp,trackers,tinker]"
# Fail loudly if anything is missing, and write the bytecode of what artrl's processes import as it loads
# (PYTHONDONTWRITEBYTECODE cleared: a machine may set it, and then every process would compile torch again):
# ~8,400 of the environment's 26,000 files, where compiling all of them took ~70 CPU-seconds on a 2-core Xeon.
# What a process imports beyond these is written the first time (scripts/test.sh and demo.sh clear it too).
PYTHONDONTWRITEBYTECODE= .venv/bin/python -c "import artrl.cli, artrl.local.backend, artrl.local.engine.hf.engine, \
artrl.local.train.trainer, transformers.models.qwen3.modeling_qwen3, transformers.models.llama.modeling_llama, \
peft, openai, anthropic, langchain_openai, langgraph.prebuilt, mcp, trl, matplotlib.pyplot, tinker, pytest"
install_previous_sdks
echo "$want" > "$stamp"
