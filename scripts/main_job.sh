#!/usr/bin/env bash
# The main job, from nothing: set up the environment (first run only), prepare the
# German-English data, train EmbRace on 2 CPU ranks, translate and score with sacrebleu.
# Extra arguments go to the recipe, e.g. `scripts/main_job.sh --arch transformer`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the recipe reports the set-up time and the wall time from this moment
export EMBRACE_JOB_T0="${EMBRACE_JOB_T0:-$(date +%s.%N)}"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${EMBRACE_VENV:-$ROOT/.venv}/bin/python" -m embrace_fairseq.recipes.main_job "$@"
