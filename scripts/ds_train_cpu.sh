#!/usr/bin/env bash
# Train a fairseq task with the EmbRace DeepSpeed engine on CPU ranks (gloo), via torchrun.
#   scripts/ds_train_cpu.sh NPROC DATA_BIN [fairseq training args...]
# Example:
#   scripts/ds_train_cpu.sh 2 data-bin/de-en --task translation --arch embrace_transformer \
#     --share-all-embeddings --max-tokens 2048 --max-epoch 1 --save-dir checkpoints/ds
# The DeepSpeed config defaults to ds_config/embrace_cpu.json (override: DS_CONFIG=...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC="${1:?usage: $0 NPROC DATA_BIN [fairseq args...]}"; shift
PY="${EMBRACE_VENV:-$ROOT/.venv}/bin/python"
export DS_ACCELERATOR=cpu
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 \
  --master_port "${MASTER_PORT:-29517}" --no-python "$PY" -m embrace_fairseq.deepspeed_adapter.train \
  "$@" --cpu --user-dir "$ROOT/user_dir" --deepspeed-config "${DS_CONFIG:-$ROOT/ds_config/embrace_cpu.json}"
