#!/usr/bin/env bash
# The language-model job: State of the Union LM on 2 CPU ranks, test perplexity with fairseq-eval-lm.
# Extra arguments go to the recipe, e.g. `scripts/lm_job.sh --arch transformer_lm`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${EMBRACE_VENV:-$ROOT/.venv}/bin/python" -m embrace_fairseq.recipes.lm "$@"
