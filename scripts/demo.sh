#!/usr/bin/env bash
# The project's main command (README): install if needed, then train the maze agent with GRPO on the
# embedded tiny model (warm start, validation, 25 steps, curve + table in demo_output/). Arguments pass
# through to examples/train_agent.py, e.g. --seed 1 or --base-model Qwen/Qwen2.5-0.5B-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of a module the first time a process imports it (a machine may set
# PYTHONDONTWRITEBYTECODE: then every process would compile again what the setup did not)
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
exec .venv/bin/python examples/train_agent.py "$@"
