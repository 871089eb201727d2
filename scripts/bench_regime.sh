#!/usr/bin/env bash
# The regime benchmark: every link calibrated to a compute-matched regime instead of a fixed rate.
#   scripts/bench_regime.sh            # about 45 min on a 2-core machine; results/bench/regime/
#   OUT=/tmp/r ROUNDS=1 STEPS=1 scripts/bench_regime.sh   # a smoke run of the same plan
# A regime (v100-25g: 30 TFLOP/s, 25 Gbit/s per GPU; a100-100g: 120 TFLOP/s, 100 Gbit/s per GPU;
# perf/simulator/regimes.py) fixes the share of a step c10d's all-reduce takes on the released model a
# workload stands for (perf/simulator/real_models.py). Each launch times the compute-only floor after
# its warm-up and sets the emulated link so that the bench's c10d bytes take that share of it; the two
# regimes are the run's links, interleaved round by round. Each report gives the limit (the floor or
# EmbRace's minimum bytes over the link, whichever is longer) and every strategy's step over it.
# Runs (each its own bench.json and report.md under results/bench/regime/<run>/):
#   w4            the main-job translation model, the tied GPT-style LM, the untied LM and the XLM-R,
#                 mBART and M2M-100 workloads on 4 ranks: every stock baseline (c10d, DeepSpeed ZeRO-1
#                 and ZeRO-2, sparse all-gather), EmbRace with the 2D schedule and the floor;
#   ablation_w2   the schedule's parts on translation and mBART, 2 ranks pinned to a core each: no overlap,
#                 FIFO overlap, the 2D schedule's priorities, + next-forward overlap, + relaxed embedding
#                 dependency (and the floor);
#   ablation_w4   the same on 4 ranks (2 ranks per core).
# Time, estimated from results/bench/full/w4 (3 models x 8 strategies x 3 links x 16 steps in 1265 s:
# ~70 s per launch to start the ranks and build the strategies, ~0.6-1.2 s per step at 4 ranks) and a
# 2-rank regime smoke run (floor ~0.9 s at a load of 7): a step of a calibrated run takes about the floor
# times (1 + 0.7 x the regime's c10d/floor ratio, 0.5 to 4 at 4 ranks), so one paired step of every
# strategy, model and regime costs ~140 s in run A and ~40 s in the ablations; with ~900 s of launches,
# warm-ups, calibrations and reports, ROUNDS x STEPS = 3 x 3 = 9 paired steps is ~900 + 9 x 180 s = ~42
# min. The XLM-R, mBART and M2M workloads' step times were not measured when this was written (assumed
# ~1 s at 4 ranks, like the tied LM); scale ROUNDS down if they are slower.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-results/bench/regime}"
REGIMES=v100-25g,a100-100g
STEPS_ARGS=(--rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-3}" --warmup 1)
bench() { "$PY" -m embrace_fairseq.perf.bench --regime "$REGIMES" "${STEPS_ARGS[@]}" "$@"; }

BASELINES=fairseq_c10d,deepspeed_zero1,deepspeed_zero2,sparse_allgather
ABLATION=embrace_noschedule,embrace_fifo,embrace_schedule,embrace_next_forward,embrace_relaxed

bench --models translation,gpt_lm,lm,xlmr,mbart,m2m --worlds 4 \
      --strategies "$BASELINES,embrace_schedule,compute_floor" --out "$OUT/w4"
bench --models translation,mbart --worlds 2 --pin-cores --strategies "$ABLATION,compute_floor" \
      --out "$OUT/ablation_w2"
bench --models translation,mbart --worlds 4 --strategies "$ABLATION,compute_floor" --out "$OUT/ablation_w4"
