#!/usr/bin/env bash
# The fault suite: every reliability scenario (soak included), then docs/RELIABILITY.md.
# Fast scenarios only: scripts/fault_suite.sh --fast. Extra pytest arguments go after --.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${EMBRACE_VENV:-$ROOT/.venv}/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--fast" ]]; then shift; exec "$PY" -m embrace_fairseq.tools.fault_report "$@"; fi
exec "$PY" -m embrace_fairseq.tools.fault_report --slow "$@"
