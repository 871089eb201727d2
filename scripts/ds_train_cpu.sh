#!/usr/bin/env bash
# Train a fairseq task with the EmbRace DeepSpeed engine on CPU ranks (gloo), via the deepspeed launcher.
#   scripts/ds_train_cpu.sh NPROC DATA_BIN [fairseq-train args...]
# Example:
#   scripts/ds_train_cpu.sh 2 data-bin/de-en --task translation --arch embrace_transformer \
#     --share-all-embeddings --max-tokens 2048 --max-epoch 1 --save-dir checkpoints/ds
# fairseq-train's loop and flags (log format, validation, checkpoints, stopping); the DeepSpeed
# config defaults to ds_config/embrace_cpu.json (override: DS_CONFIG=...). EMBRACE_LAUNCHER=torchrun
# starts the ranks with torchrun instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC="${1:?usage: $0 NPROC DATA_BIN [fairseq args...]}"; shift
VENV="${EMBRACE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PORT="${MASTER_PORT:-29517}"
export DS_ACCELERATOR=cpu
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ARGS=("$@" --cpu --user-dir "$ROOT/user_dir" --deepspeed-config "${DS_CONFIG:-$ROOT/ds_config/embrace_cpu.json}")
if [ "${EMBRACE_LAUNCHER:-deepspeed}" = torchrun ]; then
  exec "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" \
    --no-python "$PY" -m embrace_fairseq.deepspeed_adapter.train "${ARGS[@]}"
fi
# the deepspeed launcher runs on CPU (DS_ACCELERATOR=cpu): --num_gpus is the number of local ranks
exec "$PY" -m deepspeed.launcher.runner --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "$PORT" \
  --module embrace_fairseq.deepspeed_adapter.train "${ARGS[@]}"
