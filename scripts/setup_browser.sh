#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser tests (tests/local/dashboard/test_dashboard_browser.py), driven by the
# playwright package with executable_path: no browser download. Idempotent; needs root (or sudo) and apt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_browser: no apt-get here; install chromium yourself (or set ARTRL_CHROMIUM=/path/to/chrome)" >&2
  exit 1
fi
echo "installing Debian's chromium ..."
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
chromium --version
