#!/usr/bin/env bash
# The project's main command (README): install if needed, then run the demo on the embedded tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/tool_agent.py "$@"
