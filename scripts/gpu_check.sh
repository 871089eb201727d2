#!/usr/bin/env bash
# One command for what one GPU can show of EmbRace's GPU paths (see scripts/gpu_check.py):
# an NCCL world of one with the exchange forced on, fp16/bf16 EmbRace vs stock on fairseq and
# DeepSpeed, the CUDA native kernels bit-exact against the CPU reference, a memory-efficient
# fp16 resume, ZeRO-1 fp16 skipping a non-finite shard step, buffer lifetimes of asynchronous
# collectives under allocator pressure, the relaxed rows' stream beside the next forward,
# device-side collective timing, each native kernel path forced, the GPU each rank's collectives
# use when its model is built before the device is set (two ranks on one GPU refused). Writes gpu_check.json (and
# a log per check) to --out DIR, else $OUT, else results/gpu_check; the JSON is rewritten
# after every check. Each check has its own time limit; the whole run, the native build
# included, stays under 9 minutes.
#
#   scripts/gpu_check.sh                 # on a GPU machine
#   scripts/gpu_check.sh --cpu-smoke     # anywhere: the CPU-runnable parts, the rest planned
#   scripts/gpu_check.sh --dry-run       # the plan: checks, time limits, commands
#
# PYTHON selects the interpreter (default: .venv/bin/python if present, else python3).
# EMBRACE_GPU_CHECK_BUILD=0 skips building the CUDA kernels of the native extension.
set -euo pipefail
cd "$(dirname "$0")/.."
# the run's start: the driver's time limit counts the native build too
export EMBRACE_GPU_CHECK_T0="${EMBRACE_GPU_CHECK_T0:-$(date +%s)}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
smoke=0
for a in "$@"; do case "$a" in --cpu-smoke|--dry-run) smoke=1 ;; esac; done
if [ "$smoke" = 0 ] && [ "${EMBRACE_GPU_CHECK_BUILD:-1}" != 0 ] && command -v nvcc >/dev/null 2>&1; then
  # the native check needs the extension with its CUDA kernels; build it in place if missing
  if ! "$PY" -c "import embrace_fairseq._native as m, sys; sys.exit(0 if m.WITH_CUDA else 1)" 2>/dev/null; then
    # the log goes where the results go ($OUT comes back from a lent machine; /tmp does not)
    log="${OUT:-/tmp}/embrace_native_build.log"
    mkdir -p "$(dirname "$log")"
    echo "building the native extension with CUDA kernels (up to 150 s)"
    timeout 150 "$PY" setup.py build_ext --inplace >"$log" 2>&1 \
      || echo "native build failed (see $log): the native checks will be skipped"
  fi
fi
exec "$PY" scripts/gpu_check.py "$@"
