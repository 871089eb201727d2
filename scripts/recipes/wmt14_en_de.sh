#!/usr/bin/env bash
# WMT'14 English-German Transformer with EmbRace, from raw text you supply (the setup of
# fairseq's examples/translation and examples/scaling_nmt, with vocab-sharded embeddings):
#
#   1. joint sentencepiece model over train.$SRC + train.$TGT (32000 pieces)
#   2. fairseq-preprocess --joined-dictionary
#   3. train embrace_transformer_wmt_en_de (SIZE=base) or
#      embrace_transformer_vaswani_wmt_en_de_big (SIZE=big) with --share-all-embeddings,
#      launched with torchrun + fairseq-train (LAUNCHER=torchrun) or with the EmbRace
#      DeepSpeed engine (LAUNCHER=deepspeed, optimizer and lr from $DS_CONFIG)
#   4. fairseq-generate --beam 4 --lenpen 0.6 on test, sacrebleu on the detokenised output
#
# With LAUNCHER=deepspeed the schedule is DeepSpeed's WarmupLR (linear warm-up, then
# constant; DeepSpeed has no inverse-sqrt schedule) and fp16 runs without gradient clipping,
# the combination the EmbRace DeepSpeed hook supports.
#
# Usage:
#   RAW=/data/wmt14_en_de WORK=/scratch/wmt14 SIZE=big NGPUS=8 scripts/recipes/wmt14_en_de.sh
#   RAW=/data/wmt14_en_de LAUNCHER=deepspeed scripts/recipes/wmt14_en_de.sh
#   CPU=1 RAW=/tmp/raw WORK=/tmp/wmt scripts/recipes/wmt14_en_de.sh   # tiny model, 2 gloo ranks
#
# RAW holds aligned plain text (untokenised, one sentence per line):
#   train.en train.de valid.en valid.de test.en test.de
# e.g. the corpora examples/translation/prepare-wmt14en2de.sh downloads, taken before its
# Moses tokenisation and BPE (newstest2013 as valid, newstest2014 as test). The test set:
#   sacrebleu -t wmt14/full -l en-de --echo src > test.en; sacrebleu -t wmt14/full -l en-de --echo ref > test.de
#
# Every knob is an environment variable (defaults in brackets; CPU=1 changes some):
#   RAW            folder with the raw text (required)
#   WORK           output folder [$ROOT/work_dirs/wmt14_en_de]: spm/, data-bin/, checkpoints/
#   SIZE           base | big [base]
#   LAUNCHER       torchrun | deepspeed [torchrun]
#   CPU            1: tiny model, --cpu, gloo, few updates, tiny vocab, to try the recipe [0]
#   NGPUS          ranks on this node [all GPUs; CPU=1: 2]
#   SRC, TGT       languages [en, de]
#   SPM_VOCAB      sentencepiece pieces [32000; CPU=1: 300]
#   SPM_SAMPLE     sentences sampled to train sentencepiece [10000000]
#   WORKERS        fairseq-preprocess workers [8; CPU=1: 1]
#   MAX_TOKENS     tokens per rank per batch [4096; CPU=1: 1024]
#   UPDATE_FREQ    batches per update (torchrun; deepspeed: gradient_accumulation_steps in DS_CONFIG) [1]
#   LR             peak learning rate (torchrun; deepspeed reads $DS_CONFIG) [7e-4 base, 5e-4 big]
#   WARMUP         warm-up updates (torchrun) [4000; CPU=1: 10]
#   MAX_UPDATE     training updates [100000 base, 300000 big; CPU=1: 20]
#   DS_CONFIG      [ds_config/wmt14_${SIZE}_fp16.json; CPU=1: ds_config/wmt14_cpu.json]
#   DDP_BACKEND    fairseq --ddp-backend (torchrun) [legacy_ddp]
#   SAVE_DIR       [$WORK/checkpoints/${SIZE}_${LAUNCHER}]
#   LOG_INTERVAL   updates between training log lines [100; CPU=1: 5]
#   BEAM, LENPEN   decoding [4, 0.6]
#   GEN_MAX_TOKENS tokens per generation batch [8000]
#   MASTER_PORT    rendezvous port [29500]
#   LAUNCH_ARGS    extra torchrun / deepspeed arguments, e.g. for several nodes [none]
#   EXTRA_ARGS     extra fairseq training arguments, appended [none]
#   EMBRACE_VENV   environment with fairseq, deepspeed, sentencepiece, sacrebleu [$ROOT/.venv]
#
# Steps whose outputs exist are skipped (delete spm/ or data-bin/ to redo them); training
# with LAUNCHER=torchrun resumes from $SAVE_DIR/checkpoint_last.pt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

die() { echo "wmt14_en_de.sh: $*" >&2; exit 1; }
say() { echo "[wmt14_en_de] $*"; }

CPU="${CPU:-0}"
RAW="${RAW:-}"
WORK="${WORK:-$ROOT/work_dirs/wmt14_en_de}"
SIZE="${SIZE:-base}"
LAUNCHER="${LAUNCHER:-torchrun}"
SRC="${SRC:-en}"
TGT="${TGT:-de}"
VENV="${EMBRACE_VENV:-$ROOT/.venv}"
SPM_SAMPLE="${SPM_SAMPLE:-10000000}"
UPDATE_FREQ="${UPDATE_FREQ:-1}"
DDP_BACKEND="${DDP_BACKEND:-legacy_ddp}"
BEAM="${BEAM:-4}"
LENPEN="${LENPEN:-0.6}"
GEN_MAX_TOKENS="${GEN_MAX_TOKENS:-8000}"
MASTER_PORT="${MASTER_PORT:-29500}"
LAUNCH_ARGS="${LAUNCH_ARGS:-}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

case "$SIZE" in
  base) ARCH=embrace_transformer_wmt_en_de; DEFAULT_LR=7e-4; DEFAULT_MAX_UPDATE=100000 ;;
  big) ARCH=embrace_transformer_vaswani_wmt_en_de_big; DEFAULT_LR=5e-4; DEFAULT_MAX_UPDATE=300000 ;;
  *) die "SIZE must be base or big, got '$SIZE'" ;;
esac
case "$LAUNCHER" in torchrun|deepspeed) ;; *) die "LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" ;; esac

if [[ "$CPU" == 1 ]]; then
  NGPUS="${NGPUS:-2}"; SPM_VOCAB="${SPM_VOCAB:-300}"; WORKERS="${WORKERS:-1}"
  MAX_TOKENS="${MAX_TOKENS:-1024}"; WARMUP="${WARMUP:-10}"; MAX_UPDATE="${MAX_UPDATE:-20}"
  LOG_INTERVAL="${LOG_INTERVAL:-5}"
  LR="${LR:-1e-3}"; DS_CONFIG="${DS_CONFIG:-$ROOT/ds_config/wmt14_cpu.json}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR=cpu
  # a model that trains in seconds; the architecture's other settings stay
  DEVICE_ARGS=(--cpu --distributed-backend gloo
               --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32
               --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64
               --encoder-attention-heads 2 --decoder-attention-heads 2
               --num-workers 0 --no-epoch-checkpoints)
  FP16_ARGS=()
  GEN_DEVICE_ARGS=(--cpu --max-len-a 1.2 --max-len-b 10)
else
  NGPUS="${NGPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}"
  [[ "$NGPUS" -ge 1 ]] || die "no GPU found (nvidia-smi -L); set NGPUS, or CPU=1 for the CPU-sized run"
  SPM_VOCAB="${SPM_VOCAB:-32000}"; WORKERS="${WORKERS:-8}"; MAX_TOKENS="${MAX_TOKENS:-4096}"
  WARMUP="${WARMUP:-4000}"; MAX_UPDATE="${MAX_UPDATE:-$DEFAULT_MAX_UPDATE}"; LR="${LR:-$DEFAULT_LR}"
  LOG_INTERVAL="${LOG_INTERVAL:-100}"
  DS_CONFIG="${DS_CONFIG:-$ROOT/ds_config/wmt14_${SIZE}_fp16.json}"
  DEVICE_ARGS=()
  # the memory-efficient variant: the one run on a GPU so far (scripts/gpu_check.sh); plain --fp16
  # (fairseq's fp32 masters, per parameter for EmbRace models) trains too
  FP16_ARGS=(--memory-efficient-fp16)
  GEN_DEVICE_ARGS=()
fi
SAVE_DIR="${SAVE_DIR:-$WORK/checkpoints/${SIZE}_${LAUNCHER}}"

# tools from the EmbRace environment, else from PATH
tool() {
  if [[ -x "$VENV/bin/$1" ]]; then echo "$VENV/bin/$1"
  elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
  else die "'$1' not found in $VENV/bin nor on PATH: run scripts/setup.sh or set EMBRACE_VENV"; fi
}
PY="$(tool python)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # --user-dir user_dir imports embrace_fairseq

# ---------------------------------------------------------------- inputs
[[ -n "$RAW" ]] || die "set RAW to the folder holding train/valid/test.{$SRC,$TGT} (see the header of $0)"
for split in train valid test; do
  for lang in "$SRC" "$TGT"; do
    [[ -s "$RAW/$split.$lang" ]] || die "missing or empty $RAW/$split.$lang (RAW needs train, valid and test .$SRC/.$TGT plain text)"
  done
  n_src=$(wc -l < "$RAW/$split.$SRC"); n_tgt=$(wc -l < "$RAW/$split.$TGT")
  [[ "$n_src" == "$n_tgt" ]] || die "$RAW/$split.$SRC has $n_src lines but $RAW/$split.$TGT has $n_tgt"
done
[[ -f "$DS_CONFIG" || "$LAUNCHER" != deepspeed ]] || die "DeepSpeed config $DS_CONFIG not found"
mkdir -p "$WORK/spm" "$SAVE_DIR"

# ---------------------------------------------------------------- 1. joint sentencepiece
if [[ ! -f "$WORK/spm/spm.model" ]]; then
  say "training a joint sentencepiece model ($SPM_VOCAB pieces) on train.$SRC + train.$TGT"
  "$PY" - "$WORK/spm/spm" "$SPM_VOCAB" "$SPM_SAMPLE" "$RAW/train.$SRC" "$RAW/train.$TGT" <<'EOF'
import sys, sentencepiece as spm
prefix, vocab, sample, *inputs = sys.argv[1:]
spm.SentencePieceTrainer.train(
    input=",".join(inputs), model_prefix=prefix, vocab_size=int(vocab), model_type="unigram",
    character_coverage=1.0, input_sentence_size=int(sample), shuffle_input_sentence=True,
    hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary instead of an error
    minloglevel=1)
EOF
fi
for split in train valid test; do
  for lang in "$SRC" "$TGT"; do
    [[ -f "$WORK/spm/$split.$lang" ]] && continue
    say "encoding $split.$lang"
    "$PY" - "$WORK/spm/spm.model" "$RAW/$split.$lang" "$WORK/spm/$split.$lang" <<'EOF'
import os, sys, sentencepiece as spm
model, src, dst = sys.argv[1:]
sp = spm.SentencePieceProcessor(model_file=model)
with open(src, encoding="utf-8") as fin, open(dst + ".tmp", "w", encoding="utf-8") as fout:
    batch = []
    for line in fin:
        batch.append(line.rstrip("\n"))
        if len(batch) == 10000:
            fout.writelines(" ".join(p) + "\n" for p in sp.encode(batch, out_type=str)); batch = []
    fout.writelines(" ".join(p) + "\n" for p in sp.encode(batch, out_type=str))
os.replace(dst + ".tmp", dst)
EOF
  done
done

# ---------------------------------------------------------------- 2. binarise
BIN="$WORK/data-bin"
if [[ ! -f "$BIN/dict.$SRC.txt" ]]; then
  say "binarising with fairseq-preprocess --joined-dictionary"
  rm -rf "$BIN.tmp"
  "$(tool fairseq-preprocess)" --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$WORK/spm/train" --validpref "$WORK/spm/valid" --testpref "$WORK/spm/test" \
    --destdir "$BIN.tmp" --joined-dictionary --workers "$WORKERS"
  mv "$BIN.tmp" "$BIN"
fi

# ---------------------------------------------------------------- 3. train
# model, data and criterion: read by both launchers
TRAIN_ARGS=("$BIN" --user-dir "$ROOT/user_dir" --task translation --source-lang "$SRC" --target-lang "$TGT"
            --arch "$ARCH" --share-all-embeddings
            --criterion label_smoothed_cross_entropy --label-smoothing 0.1
            --max-tokens "$MAX_TOKENS" --max-update "$MAX_UPDATE" --save-dir "$SAVE_DIR"
            --seed 1 --log-format simple --log-interval "$LOG_INTERVAL" "${DEVICE_ARGS[@]}")
# fairseq's optimizer and schedule (the DeepSpeed launcher takes them from DS_CONFIG)
FAIRSEQ_ARGS=(--optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-8 --clip-norm 0.0
              --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
              --weight-decay 0.0 --update-freq "$UPDATE_FREQ" --ddp-backend "$DDP_BACKEND" "${FP16_ARGS[@]}")
# shellcheck disable=SC2206  # EXTRA_ARGS / LAUNCH_ARGS are word-split on purpose
EXTRA=($EXTRA_ARGS); LAUNCH=($LAUNCH_ARGS)

say "training $ARCH on $NGPUS $([[ $CPU == 1 ]] && echo 'CPU ranks' || echo GPUs) with $LAUNCHER, $MAX_UPDATE updates -> $SAVE_DIR"
if [[ "$LAUNCHER" == torchrun ]]; then
  "$(tool torchrun)" --nproc_per_node "$NGPUS" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" "${LAUNCH[@]}" \
    "$(tool fairseq-train)" "${TRAIN_ARGS[@]}" "${FAIRSEQ_ARGS[@]}" "${EXTRA[@]}"
else  # also on CPU ranks (DS_ACCELERATOR=cpu): --num_gpus is the number of local ranks
  "$(tool deepspeed)" --num_gpus "$NGPUS" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" "${LAUNCH[@]}" \
    --module embrace_fairseq.deepspeed_adapter.train "${TRAIN_ARGS[@]}" "${EXTRA[@]}" --deepspeed-config "$DS_CONFIG"
fi

# ---------------------------------------------------------------- 4. translate and score
CKPT="$SAVE_DIR/checkpoint_best.pt"          # both launchers validate (fairseq's loop)
[[ -f "$CKPT" ]] || CKPT="$SAVE_DIR/checkpoint_last.pt"
[[ -f "$CKPT" ]] || die "training wrote no checkpoint in $SAVE_DIR"
say "translating test.$SRC with $CKPT"
# --required-batch-size-multiple 1: this fairseq build drops a last batch that is not a
# multiple of it (8 by default), which would lose the longest test sentences
"$(tool fairseq-generate)" "$BIN" --user-dir "$ROOT/user_dir" --path "$CKPT" \
  --task translation --source-lang "$SRC" --target-lang "$TGT" --gen-subset test \
  --beam "$BEAM" --lenpen "$LENPEN" --max-tokens "$GEN_MAX_TOKENS" --post-process sentencepiece \
  --required-batch-size-multiple 1 "${GEN_DEVICE_ARGS[@]}" > "$SAVE_DIR/generate-test.txt"
# hypotheses back in corpus order ("D-<id>\t<score>\t<detokenised text>")
grep '^D-' "$SAVE_DIR/generate-test.txt" | sed 's/^D-//' | sort -t$'\t' -k1,1n | cut -f3 > "$SAVE_DIR/test.hyp.$TGT"
n_hyp=$(wc -l < "$SAVE_DIR/test.hyp.$TGT"); n_ref=$(wc -l < "$RAW/test.$TGT")
[[ "$n_hyp" == "$n_ref" ]] || die "fairseq-generate translated $n_hyp of $n_ref test sentences (see $SAVE_DIR/generate-test.txt)"
"$(tool sacrebleu)" "$RAW/test.$TGT" -i "$SAVE_DIR/test.hyp.$TGT" -m bleu -f text | tee "$SAVE_DIR/bleu.txt"
say "done: $CKPT, $SAVE_DIR/test.hyp.$TGT, $SAVE_DIR/bleu.txt"
