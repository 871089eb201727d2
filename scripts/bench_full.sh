#!/usr/bin/env bash
# The full benchmark: every run the README's figures come from, then their summary.
#   scripts/bench_full.sh            # about 70 min on a 2-core machine; results/bench/full/
#   OUT=/tmp/b ROUNDS=1 STEPS=1 scripts/bench_full.sh   # a smoke run of the same plan
# Runs (each its own bench.json and report.md under results/bench/full/<run>/), every one
# with strategies and link speeds (1, 2.5, 10 Gbit/s) interleaved round by round:
#   w4        the main-job translation model, the tied GPT-style LM (32k BPE) and the untied
#             LM on 4 ranks: every stock baseline as its users tune it, EmbRace at ZeRO-0 and
#             ZeRO-1, the compute-only floor;
#   iwslt_w4  transformer_iwslt_de_en with a tied decoder on 4 ranks; fewer strategies, so that
#             every strategy's copy of the 40M-parameter model fits in memory at once;
#   w8        the main-job translation model and the untied LM on 8 ranks, fewer strategies.
# Then results/bench/full/summary.{md,json}: every EmbRace-over-baseline ratio with its
# interval and commit, and the simulator fitted on one model and link, predicting the rest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-results/bench/full}"
# 4 rounds x 4 timed steps per strategy and link: 16 paired steps, enough for every
# ratio's 95 % interval to stay within +-10 % on this machine (12 left some at +-9 %)
STEPS_ARGS=(--steps-per-round "${STEPS:-4}")
[ -n "${ROUNDS:-}" ] && STEPS_ARGS+=(--rounds "$ROUNDS")
bench() { "$PY" -m embrace_fairseq.perf.bench ${STEPS_ARGS[@]+"${STEPS_ARGS[@]}"} "$@"; }

bench --out "$OUT/w4"
bench --models iwslt --strategies fairseq_c10d,deepspeed_zero1,embrace_schedule,embrace_zero1,compute_floor \
      --out "$OUT/iwslt_w4"
bench --models translation,lm --worlds 8 --strategies fairseq_c10d,deepspeed_zero1,embrace_schedule,compute_floor \
      --out "$OUT/w8"
"$PY" -m embrace_fairseq.perf.bench.summary "$OUT/w4" "$OUT/iwslt_w4" "$OUT/w8" --out "$OUT/summary"
