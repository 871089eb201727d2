#!/usr/bin/env bash
# The test command: set up if needed, then run the default (fast) test suite.
# Slow tests (marked `slow`) run with: scripts/test.sh -m slow
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
if [[ $# -eq 0 ]]; then set -- -m "not slow"; fi
exec "${EMBRACE_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
