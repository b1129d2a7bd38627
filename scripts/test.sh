#!/usr/bin/env bash
# The project's test command (README, .ci/run): install if needed, lint, then every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/python -m pytest -q "$@"
