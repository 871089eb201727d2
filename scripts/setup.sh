#!/usr/bin/env bash
# Set up the project from nothing on a CPU machine: a virtual environment in .venv
# with every dependency pinned (requirements/cpu-constraints.txt). Idempotent: a
# second run only checks that the environment is complete.
#
# torch is installed first, pinned to 2.13.0+cpu (the CPU build; PyPI's Linux torch is the
# multi-GB CUDA one), from PyPI plus PyTorch's CPU wheel index, and fairseq-fixed and
# DeepSpeed are built against it without build isolation: with isolation pip would
# fetch an unpinned (CUDA) torch just to build them.
#
#   EMBRACE_TORCH_INDEX  the index that serves torch 2.13.0+cpu (default PyTorch's,
#                        https://download.pytorch.org/whl/cpu; a mirror of it; empty: none,
#                        pip's own configuration (index, find-links) provides the wheel)
#   EMBRACE_VENV         where the environment goes (default .venv)
#   PYTHON               the interpreter that creates it (default python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EMBRACE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_INDEX="${EMBRACE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
C="$ROOT/requirements/cpu-constraints.txt"
# Two stamps: the environment (pins and setup.py) and the native extension (every file of
# csrc/ and EMBRACE_BUILD_NATIVE). A change in csrc/ rebuilds the extension alone, so the
# tests never meet a stale one (they fail on a stale or missing build unless
# EMBRACE_BUILD_NATIVE=0 or no C++ compiler exists).
STAMP="$VENV/.embrace-setup-$(sha1sum "$C" "$ROOT/setup.py" | sha1sum | cut -c1-12)"
NATIVE_KEY="$( (cd "$ROOT" && find csrc -type f 2>/dev/null | LC_ALL=C sort | xargs -r sha1sum
               echo "EMBRACE_BUILD_NATIVE=${EMBRACE_BUILD_NATIVE:-1}") | sha1sum | cut -c1-12)"
NATIVE_STAMP="$VENV/.embrace-native-$NATIVE_KEY"

if [[ -f "$STAMP" && -f "$NATIVE_STAMP" ]]; then
  exit 0
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# Machines of this kind configure pip with an extra local index folder that lacks most
# packages; pip then warns once per package it looks up ("Location '...' is ignored: it is
# neither a file nor a directory"), about 60 lines of set-up output. Harmless: only that
# line is dropped, every other message and pip's exit status stay.
pip_install() {
  "${PIP[@]}" install "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# pip retries an index that does not answer, for every package it looks up (seconds to
# minutes each): ask once, briefly, and leave an unreachable index out.
index_answers() {
  "$VENV/bin/python" - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
except Exception as exc:
    print(f"[setup] {sys.argv[1]} does not answer ({exc}); looking for the CPU torch wheel "
          "on pip's configured indexes and find-links instead (EMBRACE_TORCH_INDEX names another)")
    sys.exit(1)
PY
}

native_done() {
  rm -f "$VENV"/.embrace-native-*
  touch "$NATIVE_STAMP"
}

if [[ -f "$STAMP" ]]; then
  echo "[setup] csrc/ or EMBRACE_BUILD_NATIVE changed: rebuilding the native extension"
  rm -f "$ROOT"/embrace_fairseq/_native*.so  # never leave a stale build behind
  pip_install --no-build-isolation --no-deps -e "$ROOT"
  native_done
  exit 0
fi
echo "[setup] creating $VENV (first run builds fairseq; about 8 minutes on 2 cores)"
"$PY" -m venv "$VENV"
rm -f "$ROOT"/embrace_fairseq/_native*.so
TORCH_FROM=()
if [[ -n "$TORCH_INDEX" ]] && index_answers "$TORCH_INDEX"; then
  TORCH_FROM=(--extra-index-url "$TORCH_INDEX")
fi
pip_install ${TORCH_FROM[@]+"${TORCH_FROM[@]}"} -c "$C" torch
pip_install -c "$C" numpy cython setuptools wheel ninja packaging
pip_install --no-build-isolation -c "$C" fairseq-fixed deepspeed sacrebleu sentencepiece pytest matplotlib
pip_install --no-build-isolation --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'PY'
# installed and importable, read without importing them (their import-time log lines are
# not set-up output)
from importlib import metadata, util
for mod in ("torch", "fairseq", "deepspeed", "sacrebleu", "sentencepiece"):
    assert util.find_spec(mod) is not None, f"{mod} is not importable"
v = {d: metadata.version(d) for d in ("torch", "fairseq-fixed", "deepspeed")}
assert v["torch"] == "2.13.0+cpu", v["torch"]
print(f"[setup] torch {v['torch']} fairseq {v['fairseq-fixed']} deepspeed {v['deepspeed']}")
PY
touch "$STAMP"
native_done
