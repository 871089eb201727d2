#!/usr/bin/env bash
# The regime benchmark: every link calibrated to a compute-matched regime instead of a fixed rate.
#   scripts/bench_regime.sh            # about 55 min on a 2-core machine; results/bench/regime/
#   OUT=/tmp/r ROUNDS=1 STEPS=1 scripts/bench_regime.sh   # a smoke run of the same plan
# A regime (v100-25g: 30 TFLOP/s, 25 Gbit/s per GPU; a100-100g: 120 TFLOP/s, 100 Gbit/s per GPU;
# perf/simulator/regimes.py) fixes the share of a step c10d's all-reduce takes on the released model a
# workload stands for (perf/simulator/real_models.py). Each launch times the compute-only floor after
# its warm-up and sets the emulated link so that the bench's c10d bytes take that share of it; the two
# regimes are the run's links, interleaved round by round. Each report gives the limit (the floor or
# EmbRace's minimum bytes over the link, whichever is longer) and every strategy's step over it.
# Runs (each its own bench.json and report.md under results/bench/regime/<run>/):
#   w4            the main-job translation model, the tied GPT-style LM and the untied LM on 4 ranks:
#                 every stock baseline (c10d, DeepSpeed ZeRO-1 and ZeRO-2, sparse all-gather), EmbRace
#                 with the 2D schedule and the floor; 4 rounds x 2 steps (about 15 min);
#   xlmr_w2, m2m_w2  the XLM-R and M2M-100 workloads on 2 ranks pinned to a core each, the same
#                 strategies; 3 rounds x 1 step (about 18 and 15 min). 4 ranks do not fit: an XLM-R
#                 rank peaks at 7.5 GB (the masked positions' logits over 250k rows, the feed-forward
#                 activations of 8,192 tokens) and 4 ranks would need about 29 GB of this machine's 23;
#   ablation_w2   the schedule's parts on the translation model, 2 ranks pinned to a core each: no
#                 overlap, FIFO overlap, the 2D schedule, + next-forward overlap, + relaxed embedding
#                 dependency, and the floor; 3 rounds x 2 steps (about 6 min).
# Not in the default plan: `MBART=1` adds the mBART workload on 2 pinned ranks. Its floor step is
# about 20 s per rank on this machine and its real model's c10d / floor ratio is about 4, so a stock
# strategy's step is about 100 s: one round of both regimes costs about 15 min, a run with an
# interval about an hour.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-results/bench/regime}"
REGIMES=v100-25g,a100-100g
bench() { "$PY" -m embrace_fairseq.perf.bench --regime "$REGIMES" --warmup 1 "$@"; }

BASELINES=fairseq_c10d,deepspeed_zero1,deepspeed_zero2,sparse_allgather
ABLATION=embrace_noschedule,embrace_fifo,embrace_schedule,embrace_next_forward,embrace_relaxed

bench --models translation,gpt_lm,lm --worlds 4 --rounds "${ROUNDS:-4}" --steps-per-round "${STEPS:-2}" \
      --strategies "$BASELINES,embrace_schedule,compute_floor" --out "$OUT/w4"
for m in xlmr m2m ${MBART:+mbart}; do
  bench --models "$m" --worlds 2 --pin-cores --rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-1}" \
        --calibration-steps 2 --strategies "$BASELINES,embrace_schedule,compute_floor" --out "$OUT/${m}_w2"
done
bench --models translation --worlds 2 --pin-cores --rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-2}" \
      --strategies "$ABLATION,compute_floor" --out "$OUT/ablation_w2"
"$PY" -m embrace_fairseq.perf.bench.regime_goals "$OUT/w4" "$OUT/xlmr_w2" "$OUT/m2m_w2" "$OUT/ablation_w2" \
      --out "$OUT/goals.md"
