#!/usr/bin/env bash
# EmbRace against the stock data-parallel paths on an emulated cluster.
#   scripts/bench.sh --quick          # 2 and 4 ranks, 1 Gbit/s (5 min idle, ~13 min on a busy 2-core machine)
#   scripts/bench.sh                  # full: 2 and 4 ranks, 1 and 10 Gbit/s (~35 min here)
#   scripts/bench.sh --cleanup        # remove namespaces left by a killed run
# Results: results/bench/<quick|full>/{bench.json,report.md,*.png,traces/}. Needs root for
# network namespaces; without them the ranks run on loopback and the report says so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m embrace_fairseq.perf.bench "$@"
