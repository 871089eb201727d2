#!/usr/bin/env bash
# Set up the project on a GPU machine, in the active Python environment (a virtual
# environment or the cluster's own), around the CUDA build of torch already installed
# there: that torch is kept, never replaced. Versions: requirements/gpu-constraints.txt.
#
# The build tools come first; fairseq-fixed, DeepSpeed and the project (with its CUDA
# kernels when nvcc is on PATH) then build without isolation, against the installed torch:
# with isolation pip would fetch another torch just to build them.
#
#   PYTHON  the environment's interpreter (default: python3 on PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
C="$ROOT/requirements/gpu-constraints.txt"

fail() {
  echo "embrace: error: $*" >&2
  exit 2
}

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__ if torch.version.cuda else "")' 2>/dev/null)" ||
  fail "torch is not importable by $PY: install the CUDA build of torch your cluster uses first" \
       "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu130), or use scripts/setup.sh on CPU"
[[ -n "$TORCH_VERSION" ]] ||
  fail "the torch of $PY is a CPU build: install the CUDA build first, or use scripts/setup.sh on CPU"
if "$PY" -m pip show -q fairseq >/dev/null 2>&1; then
  fail "PyPI's fairseq is installed in this environment; fairseq-fixed provides the same module and" \
       "commands and cannot coexist with it: pip uninstall fairseq"
fi

# the installed torch, pinned for every step below
KEEP="$(mktemp)"
trap 'rm -f "$KEEP"' EXIT
echo "torch==$TORCH_VERSION" >"$KEEP"
PIP=("$PY" -m pip install --disable-pip-version-check -c "$C" -c "$KEEP")

echo "[setup_gpu] torch $TORCH_VERSION (kept); build tools, then fairseq-fixed and DeepSpeed"
"${PIP[@]}" setuptools wheel ninja packaging cython
"${PIP[@]}" --no-build-isolation fairseq-fixed deepspeed hydra-core omegaconf sacrebleu sentencepiece numpy psutil pytest
"${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
"$PY" - "$TORCH_VERSION" <<'PY'
import sys
from importlib import metadata
import torch
assert torch.__version__ == sys.argv[1], f"torch changed: {sys.argv[1]} -> {torch.__version__}"
try:
    import embrace_fairseq._native as native
    ops = "with CUDA kernels" if native.WITH_CUDA else "CPU only (no nvcc at build time)"
except ImportError:
    ops = "not built (see the warning above); the package works without them"
print(f"[setup_gpu] torch {torch.__version__} (CUDA {torch.version.cuda}), fairseq-fixed "
      f"{metadata.version('fairseq-fixed')}, deepspeed {metadata.version('deepspeed')}; native ops {ops}")
PY
echo "[setup_gpu] done; scripts/gpu_check.sh checks the GPU paths on one GPU"
