#!/usr/bin/env bash
# The regime benchmark: every link calibrated to a compute-matched regime instead of a fixed rate.
#   scripts/bench_regime.sh            # about 2 h on a 2-core machine with jemalloc; results/bench/regime/
#   OUT=/tmp/r ROUNDS=1 STEPS=1 scripts/bench_regime.sh   # a smoke run of the same plan
#   RUNS="w4 m2m_w2" scripts/bench_regime.sh      # only these runs; the goals read every folder there
# A regime (v100-25g: 30 TFLOP/s, 25 Gbit/s per GPU; a100-100g: 120 TFLOP/s, 100 Gbit/s per GPU;
# perf/simulator/regimes.py) fixes the share of a step c10d's all-reduce takes on the released model a
# workload stands for (perf/simulator/real_models.py). Each launch times the compute-only floor after
# its warm-up (once two untimed steps agree) and sets the emulated link so that the bench's c10d bytes take that share of it; the two
# regimes are the run's links, interleaved round by round. Each report gives the limit (the floor or
# EmbRace's minimum bytes over the link, whichever is longer) and every strategy's step over it.
# Every run a page cites times at least 8 steps per strategy (rounds x steps per round; the goals give no
# verdict on fewer); each strategy warms up until two untimed steps agree (at most --max-warmup); every
# bucket is its experts' setting scaled with the model (perf/bench/shapes.py) and recorded in bench.json.
# Runs (each its own bench.json and report.md under results/bench/regime/<run>/):
#   w4            the main-job translation model and the GPT-2-shaped LM on 4 ranks (W4_MODELS adds the
#                 synthetic untied LM, `lm`): every stock baseline (c10d, DeepSpeed ZeRO-1 and ZeRO-2, sparse
#                 all-gather after and during the backward), EmbRace with the 2D schedule, the default plan
#                 (embrace_auto) and the floor; 4 rounds x 2 steps, each regime its own launch (about 15 min);
#   mbart_w2, m2m_w2, xlmr_w2  mBART, M2M-100 and XLM-R on 2 ranks pinned to a core each: c10d, ZeRO-2,
#                 the sparse all-gather during the backward, EmbRace with the 2D schedule, the default plan
#                 and the floor (8 steps of each strategy must fit; the two baselines left out run in
#                 mbart_more_w2; LARGE_STRATEGIES names others); 8 rounds x 1 step, each regime its own launch (about 20 min per model). 4 ranks
#                 do not fit: an XLM-R rank peaks at 7.5 GB (the masked positions' logits over 250k rows,
#                 the feed-forward activations of 8,192 tokens), 4 ranks would need about 29 GB of 23;
#   mbart_more_w2 the baselines mbart_w2 leaves out (ZeRO-1, the sparse all-gather after the backward)
#                 against EmbRace with the 2D schedule and the floor, both regimes in one launch; 8 rounds
#                 x 1 step (about 15 min);
#   mbart_deferred_w2  the output layer's table gradient in its backward against deferred, mBART on 2
#                 pinned ranks, both regimes in one launch; 8 rounds x 1 step (about 12 min);
#   ablation_w2   the schedule's parts on the translation model, 2 ranks pinned to a core each: no
#                 overlap, FIFO overlap, the 2D schedule, + next-forward overlap, + relaxed embedding
#                 dependency, and the floor; 3 rounds x 4 steps (about 2 min: next-forward overlap
#                 finishes its round's last step on the clock, so each round carries one step whose
#                 communication nothing hides; more steps per round, less of it per step);
#   ablation_w4   the same parts on 4 ranks, with the layout (contiguous shards) and the output rule
#                 (--embrace-output gather, vocab-parallel; the default auto picks one per step);
#                 3 rounds x 3 steps (about 5 min);
#   nodes_2x2     the translation model on 2 nodes of 2 ranks (one namespace per node: fast inside,
#                 the regime's link between): c10d, the sparse all-gather, EmbRace flat, with the
#                 node-aware exchange and with the two-level all-reduce (about 2 min);
#   xlmr_layout_w2  the layout and the output rule on XLM-R, 2 pinned ranks (8 rounds x 1 step, about 15 min).
# Runs outside the plan, for a machine with more memory (`RUNS="xlmr_w4 mbart_w4 m2m_w4 layout_w8"`):
#   xlmr_w4, mbart_w4, m2m_w4  the large vocabularies on the 4 ranks their goals name, every baseline
#                 (each rank peaks at 6-9 GB: about 35 GB in all); 8 rounds x 1 step;
#   layout_w8     strided against contiguous shards on XLM-R and mBART at 8 ranks, with the floor
#                 (about 60 GB; give it 8 cores and PIN=1 so that the cores do not decide).
#   On a machine without that memory the launcher stops the ranks once less than 1.5 GB is left
#   (--memory-reserve-gb) and says what each rank held.
# `MBART=1` adds mBART's schedule ablation on 2 pinned ranks in both regimes, with the schedule whose output
# layer computes the table gradient in its backward (no split), 3 rounds x 3 steps (about 25 min with jemalloc;
# its first floor step is cold, about 24 s, then about 2.7 s).
# The goals (results/bench/regime/goals.md) end with the simulator fitted once on the translation
# model in v100-25g and every other workload of every folder predicted out of sample.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-results/bench/regime}"
REGIMES=v100-25g,a100-100g
# The ranks' allocator: jemalloc keeping its freed pages, as a GPU's caching allocator does
# (perf/bench/allocator.py: with glibc's, the large-vocabulary steps fault their big blocks in
# again every step, which slows the stock paths most). Installed here where apt-get can.
if ! "$PY" -c "from embrace_fairseq.perf.bench.allocator import find_jemalloc as f; raise SystemExit(f() is None)"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libjemalloc2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libjemalloc2 >/dev/null 2>&1; } || true
  fi
fi
bench() { "$PY" -m embrace_fairseq.perf.bench --regime "$REGIMES" --warmup 1 --allocator "${ALLOCATOR:-auto}" "$@"; }
# The runs with the default plan (embrace_auto) launch once per regime: a plan is decided once, on
# the link a job starts on, so each regime's run is its own (results in $OUT/<run>/<regime>/).
per_regime() {
  local out="$1"; shift
  for regime in ${REGIMES//,/ }; do
    "$PY" -m embrace_fairseq.perf.bench --regime "$regime" --warmup 1 --allocator "${ALLOCATOR:-auto}" "$@" \
          --out "$out/$regime"
  done
}

BASELINES=fairseq_c10d,deepspeed_zero1,deepspeed_zero2,sparse_allgather,sparse_allgather_overlap
LARGE=fairseq_c10d,deepspeed_zero2,sparse_allgather_overlap,embrace_schedule,embrace_auto,compute_floor
ABLATION=embrace_noschedule,embrace_fifo,embrace_schedule,embrace_next_forward,embrace_relaxed
LAYOUT_OUTPUT=embrace_contiguous,embrace_output_gather,embrace_output_vocab_parallel

run_w4() {
  per_regime "$OUT/w4" --models "${W4_MODELS:-translation,gpt_lm}" --worlds 4 --rounds "${ROUNDS:-4}" --steps-per-round "${STEPS:-2}" \
        --strategies "$BASELINES,embrace_schedule,embrace_auto,compute_floor"
}
large_w2() {
  # 3 calibration steps: the link follows their median, which one slow step does not move (M2M-100's
  # runs with 2 drifted, a floor step of 3.3-3.9 s among 1.8 s ones; mBART's and XLM-R's held)
  per_regime "$OUT/$1_w2" --models "$1" --worlds 2 --pin-cores --rounds "${ROUNDS:-8}" --steps-per-round "${STEPS:-1}" \
        --calibration-steps 3 --timeout 9000 \
        --strategies "${LARGE_STRATEGIES:-$LARGE}"
}
run_xlmr_w2() { large_w2 xlmr; }
mbart_both_regimes() {  # $1: the run's name, $2: its strategies; both regimes in one launch
  bench --models mbart --worlds 2 --pin-cores --rounds "${ROUNDS:-8}" --steps-per-round "${STEPS:-1}" --calibration-steps 3 \
        --timeout 9000 --strategies "$2,compute_floor" --out "$OUT/$1"
}
run_mbart_more_w2() { mbart_both_regimes mbart_more_w2 deepspeed_zero1,sparse_allgather,embrace_schedule; }
run_mbart_deferred_w2() { mbart_both_regimes mbart_deferred_w2 embrace_schedule,embrace_eager_output_grad; }
run_m2m_w2() { large_w2 m2m; }
run_mbart_w2() { large_w2 mbart; }
large_w4() {  # 2 ranks per core here; XLM-R's and mBART's runs for a machine with more memory
  bench --models "$1" --worlds 4 --rounds "${ROUNDS:-8}" --steps-per-round "${STEPS:-1}" --calibration-steps 2 \
        --timeout 12000 --strategies "$BASELINES,embrace_schedule,compute_floor" --out "$OUT/$1_w4"
}
run_m2m_w4() { large_w4 m2m; }
run_xlmr_w4() { large_w4 xlmr; }
run_mbart_w4() { large_w4 mbart; }
run_ablation_w2() {
  bench --models translation --worlds 2 --pin-cores --rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-4}" \
        --strategies "$ABLATION,compute_floor" --out "$OUT/ablation_w2"
}
run_ablation_w4() {
  bench --models translation --worlds 4 --rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-3}" \
        --strategies "$ABLATION,$LAYOUT_OUTPUT,compute_floor" --out "$OUT/ablation_w4"
}
run_nodes_2x2() {
  bench --models translation --worlds 4 --ranks-per-node 2 --rounds "${ROUNDS:-4}" --steps-per-round "${STEPS:-2}" \
        --strategies fairseq_c10d,sparse_allgather,embrace_schedule,embrace_node,embrace_two_level,compute_floor \
        --out "$OUT/nodes_2x2"
}
run_xlmr_layout_w2() {
  bench --models xlmr --worlds 2 --pin-cores --rounds "${ROUNDS:-8}" --steps-per-round "${STEPS:-1}" --calibration-steps 2 \
        --timeout 6000 --strategies embrace_schedule,embrace_contiguous,embrace_output_gather,compute_floor --out "$OUT/xlmr_layout_w2"
}
run_layout_w8() {
  bench --models xlmr,mbart --worlds 8 ${PIN:+--pin-cores} --rounds "${ROUNDS:-8}" --steps-per-round "${STEPS:-1}" \
        --calibration-steps 2 --timeout 9000 --strategies embrace_schedule,embrace_contiguous,compute_floor \
        --out "$OUT/layout_w8"
}
run_mbart_ablation_w2() {  # the schedule's parts, and the schedule without the split output backward
  bench --models mbart --worlds 2 --pin-cores --rounds "${ROUNDS:-3}" --steps-per-round "${STEPS:-3}" --calibration-steps 3 \
        --timeout 9000 --strategies "$ABLATION,embrace_eager_output_grad,compute_floor" --out "$OUT/mbart_ablation_w2"
}

PLAN=(w4 mbart_w2 m2m_w2 xlmr_w2 mbart_more_w2 mbart_deferred_w2 ablation_w2 ablation_w4 nodes_2x2 xlmr_layout_w2 ${MBART:+mbart_ablation_w2})
for run in ${RUNS:-${PLAN[@]}}; do
  declare -F "run_$run" >/dev/null || { echo "bench_regime.sh: no run named '$run' (runs: ${PLAN[*]} mbart_ablation_w2 xlmr_w4 mbart_w4 m2m_w4 layout_w8)" >&2; exit 2; }
  "run_$run"
done
# the goals read every results folder there, a run's or a run's regime's (a RUNS subset keeps the others')
FOLDERS=()
while IFS= read -r f; do FOLDERS+=("$(dirname "$f")"); done < <(find "$OUT" -name bench.json | sort)
"$PY" -m embrace_fairseq.perf.bench.regime_goals "${FOLDERS[@]}" --fit-on translation:v100-25g --out "$OUT/goals.md"
