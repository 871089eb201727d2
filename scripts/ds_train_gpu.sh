#!/usr/bin/env bash
# Train a fairseq task with the EmbRace DeepSpeed engine on N GPUs of this node.
#   scripts/ds_train_gpu.sh NUM_GPUS DATA_BIN [fairseq training args...]
# The DeepSpeed config defaults to ds_config/embrace_fp16_gpu.json (override: DS_CONFIG=...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NGPU="${1:?usage: $0 NUM_GPUS DATA_BIN [fairseq args...]}"; shift
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec deepspeed --num_gpus "$NGPU" "$ROOT/embrace_fairseq/deepspeed_adapter/train.py" \
  "$@" --user-dir "$ROOT/user_dir" --deepspeed-config "${DS_CONFIG:-$ROOT/ds_config/embrace_fp16_gpu.json}"
