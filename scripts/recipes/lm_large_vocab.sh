#!/usr/bin/env bash
# Large-vocabulary Transformer language model with EmbRace, from raw text you supply
# (WikiText-103 style; the case where the embedding table dominates the parameters):
#
#   1. tokens: a sentencepiece model of 64000 pieces (TOKENIZE=spm), or the words as they
#      are (TOKENIZE=word, for pre-tokenised text such as WikiText-103: ~267k words)
#   2. fairseq-preprocess --only-source
#   3. train embrace_transformer_lm_gpt (MODEL=gpt) or a WikiText-103-sized model
#      (MODEL=wiki103, see below) with a tied input/output embedding, launched with torchrun +
#      fairseq-train (LAUNCHER=torchrun) or with the EmbRace DeepSpeed engine
#      (LAUNCHER=deepspeed, optimizer and lr from $DS_CONFIG)
#   4. fairseq-eval-lm perplexity on test
#
# With LAUNCHER=deepspeed the schedule is DeepSpeed's WarmupLR (linear warm-up, then
# constant; DeepSpeed has no inverse-sqrt schedule) and fp16 runs without gradient clipping,
# the combination the EmbRace DeepSpeed hook supports.
#
# Usage:
#   RAW=/data/wikitext-103 TOKENIZE=word NGPUS=8 scripts/recipes/lm_large_vocab.sh
#   RAW=/data/my_text SPM_VOCAB=128000 LAUNCHER=deepspeed scripts/recipes/lm_large_vocab.sh
#   CPU=1 RAW=/tmp/raw WORK=/tmp/lm scripts/recipes/lm_large_vocab.sh   # tiny model, 2 gloo ranks
#
# RAW holds plain text, one paragraph or sentence per line: train.txt valid.txt test.txt,
# or WikiText-103's wiki.train.tokens wiki.valid.tokens wiki.test.tokens.
#
# MODEL=wiki103 is fairseq's transformer_lm_wiki103 (16 layers, 1024 dims, 4096 FFN, 8 heads,
# dropout 0.3) without adaptive input/softmax: --arch embrace_transformer_lm with those sizes.
# (--arch embrace_transformer_lm_wiki103 turns adaptive input on, which a sharded table
# cannot do, and fairseq has no flag to turn it off again.)
#
# Every knob is an environment variable (defaults in brackets; CPU=1 changes some):
#   RAW            folder with the raw text (required)
#   WORK           output folder [$ROOT/work_dirs/lm_large_vocab]: tok/, data-bin/, checkpoints/
#   TOKENIZE       spm | word [spm]
#   SPM_VOCAB      sentencepiece pieces [64000; CPU=1: 300]
#   SPM_SAMPLE     sentences sampled to train sentencepiece [10000000]
#   NWORDS         TOKENIZE=word: keep the NWORDS most frequent words, -1 all [-1]
#   MODEL          gpt | wiki103 [gpt]
#   LAUNCHER       torchrun | deepspeed [torchrun]
#   CPU            1: tiny model, --cpu, gloo, few updates, tiny vocab, to try the recipe [0]
#   NGPUS          ranks on this node [all GPUs; CPU=1: 2]
#   WORKERS        fairseq-preprocess workers [8; CPU=1: 1]
#   TOKENS_PER_SAMPLE  block length [512; CPU=1: 64]
#   MAX_TOKENS     tokens per rank per batch [2048; CPU=1: 1024]
#   UPDATE_FREQ    batches per update (torchrun; deepspeed: gradient_accumulation_steps in DS_CONFIG)
#                  [16/NGPUS: 32k tokens per update, as fairseq's example]
#   LR             peak learning rate (torchrun; deepspeed reads $DS_CONFIG) [5e-4]
#   WARMUP         warm-up updates (torchrun) [4000; CPU=1: 10]
#   MAX_UPDATE     training updates [50000; CPU=1: 20]
#   DS_CONFIG      [ds_config/lm_large_vocab_fp16.json; CPU=1: ds_config/lm_large_vocab_cpu.json]
#   DDP_BACKEND    fairseq --ddp-backend (torchrun) [legacy_ddp]
#   SAVE_DIR       [$WORK/checkpoints/${MODEL}_${LAUNCHER}]
#   LOG_INTERVAL   updates between training log lines [100; CPU=1: 5]
#   CONTEXT_WINDOW fairseq-eval-lm --context-window [400; CPU=1: 32]
#   EVAL_BATCH_SIZE  fairseq-eval-lm --batch-size [2; CPU=1: 8]
#   MASTER_PORT    rendezvous port [29500]
#   LAUNCH_ARGS    extra torchrun / deepspeed arguments, e.g. for several nodes [none]
#   EXTRA_ARGS     extra fairseq training arguments, appended [none]
#   EMBRACE_VENV   environment with fairseq, deepspeed, sentencepiece [$ROOT/.venv]
#
# Steps whose outputs exist are skipped (delete tok/ or data-bin/ to redo them); training
# with LAUNCHER=torchrun resumes from $SAVE_DIR/checkpoint_last.pt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

die() { echo "lm_large_vocab.sh: $*" >&2; exit 1; }
say() { echo "[lm_large_vocab] $*"; }

CPU="${CPU:-0}"
RAW="${RAW:-}"
WORK="${WORK:-$ROOT/work_dirs/lm_large_vocab}"
TOKENIZE="${TOKENIZE:-spm}"
MODEL="${MODEL:-gpt}"
LAUNCHER="${LAUNCHER:-torchrun}"
VENV="${EMBRACE_VENV:-$ROOT/.venv}"
SPM_SAMPLE="${SPM_SAMPLE:-10000000}"
NWORDS="${NWORDS:--1}"
LR="${LR:-5e-4}"
DDP_BACKEND="${DDP_BACKEND:-legacy_ddp}"
MASTER_PORT="${MASTER_PORT:-29500}"
LAUNCH_ARGS="${LAUNCH_ARGS:-}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

case "$TOKENIZE" in spm|word) ;; *) die "TOKENIZE must be spm or word, got '$TOKENIZE'" ;; esac
case "$LAUNCHER" in torchrun|deepspeed) ;; *) die "LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" ;; esac
case "$MODEL" in
  gpt) MODEL_ARGS=(--arch embrace_transformer_lm_gpt) ;;
  wiki103) MODEL_ARGS=(--arch embrace_transformer_lm --decoder-layers 16 --decoder-embed-dim 1024
                       --decoder-ffn-embed-dim 4096 --decoder-attention-heads 8 --dropout 0.3
                       --attention-dropout 0.1 --activation-dropout 0.1 --no-decoder-final-norm) ;;
  *) die "MODEL must be gpt or wiki103, got '$MODEL'" ;;
esac

if [[ "$CPU" == 1 ]]; then
  NGPUS="${NGPUS:-2}"; SPM_VOCAB="${SPM_VOCAB:-300}"; WORKERS="${WORKERS:-1}"
  TOKENS_PER_SAMPLE="${TOKENS_PER_SAMPLE:-64}"; MAX_TOKENS="${MAX_TOKENS:-1024}"
  WARMUP="${WARMUP:-10}"; MAX_UPDATE="${MAX_UPDATE:-20}"; LOG_INTERVAL="${LOG_INTERVAL:-5}"
  CONTEXT_WINDOW="${CONTEXT_WINDOW:-32}"
  EVAL_BATCH_SIZE="${EVAL_BATCH_SIZE:-8}"
  DS_CONFIG="${DS_CONFIG:-$ROOT/ds_config/lm_large_vocab_cpu.json}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR=cpu
  # a model that trains in seconds; the architecture's other settings stay
  DEVICE_ARGS=(--cpu --distributed-backend gloo --decoder-layers 1 --decoder-embed-dim 32
               --decoder-ffn-embed-dim 64 --decoder-attention-heads 2 --num-workers 0 --no-epoch-checkpoints)
  FP16_ARGS=()
  EVAL_DEVICE_ARGS=(--cpu --num-workers 0)
else
  NGPUS="${NGPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}"
  [[ "$NGPUS" -ge 1 ]] || die "no GPU found (nvidia-smi -L); set NGPUS, or CPU=1 for the CPU-sized run"
  SPM_VOCAB="${SPM_VOCAB:-64000}"; WORKERS="${WORKERS:-8}"
  TOKENS_PER_SAMPLE="${TOKENS_PER_SAMPLE:-512}"; MAX_TOKENS="${MAX_TOKENS:-2048}"
  WARMUP="${WARMUP:-4000}"; MAX_UPDATE="${MAX_UPDATE:-50000}"; LOG_INTERVAL="${LOG_INTERVAL:-100}"
  CONTEXT_WINDOW="${CONTEXT_WINDOW:-400}"
  EVAL_BATCH_SIZE="${EVAL_BATCH_SIZE:-2}"
  DS_CONFIG="${DS_CONFIG:-$ROOT/ds_config/lm_large_vocab_fp16.json}"
  DEVICE_ARGS=()
  # the memory-efficient variant: the one run on a GPU so far (scripts/gpu_check.sh); plain --fp16
  # (fairseq's fp32 masters, per parameter for EmbRace models) trains too
  FP16_ARGS=(--memory-efficient-fp16)
  EVAL_DEVICE_ARGS=()
fi
UPDATE_FREQ="${UPDATE_FREQ:-$(( NGPUS >= 16 ? 1 : 16 / NGPUS ))}"
SAVE_DIR="${SAVE_DIR:-$WORK/checkpoints/${MODEL}_${LAUNCHER}}"

# tools from the EmbRace environment, else from PATH
tool() {
  if [[ -x "$VENV/bin/$1" ]]; then echo "$VENV/bin/$1"
  elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
  else die "'$1' not found in $VENV/bin nor on PATH: run scripts/setup.sh or set EMBRACE_VENV"; fi
}
PY="$(tool python)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # --user-dir user_dir imports embrace_fairseq

# ---------------------------------------------------------------- inputs
[[ -n "$RAW" ]] || die "set RAW to the folder holding train.txt, valid.txt, test.txt (see the header of $0)"
declare -A TEXT
for split in train valid test; do
  if [[ -s "$RAW/$split.txt" ]]; then TEXT[$split]="$RAW/$split.txt"
  elif [[ -s "$RAW/wiki.$split.tokens" ]]; then TEXT[$split]="$RAW/wiki.$split.tokens"
  else die "missing or empty $RAW/$split.txt (nor $RAW/wiki.$split.tokens): RAW needs train, valid and test text"; fi
done
[[ -f "$DS_CONFIG" || "$LAUNCHER" != deepspeed ]] || die "DeepSpeed config $DS_CONFIG not found"
mkdir -p "$WORK/tok" "$SAVE_DIR"

# ---------------------------------------------------------------- 1. tokens
TOK="$WORK/tok/$TOKENIZE"
mkdir -p "$TOK"
if [[ "$TOKENIZE" == spm && ! -f "$TOK/spm.model" ]]; then
  say "training a sentencepiece model ($SPM_VOCAB pieces) on ${TEXT[train]}"
  "$PY" - "$TOK/spm" "$SPM_VOCAB" "$SPM_SAMPLE" "${TEXT[train]}" <<'EOF'
import sys, sentencepiece as spm
prefix, vocab, sample, text = sys.argv[1:]
spm.SentencePieceTrainer.train(
    input=text, model_prefix=prefix, vocab_size=int(vocab), model_type="unigram",
    character_coverage=0.9999, input_sentence_size=int(sample), shuffle_input_sentence=True,
    max_sentence_length=1 << 16,  # WikiText paragraphs exceed the default 4192 bytes
    hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary instead of an error
    minloglevel=1)
EOF
fi
for split in train valid test; do
  [[ -f "$TOK/$split.txt" ]] && continue
  if [[ "$TOKENIZE" == word ]]; then
    ln -s "$(cd "$(dirname "${TEXT[$split]}")" && pwd)/$(basename "${TEXT[$split]}")" "$TOK/$split.txt"
    continue
  fi
  say "encoding $split"
  "$PY" - "$TOK/spm.model" "${TEXT[$split]}" "$TOK/$split.txt" <<'EOF'
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

# ---------------------------------------------------------------- 2. binarise
BIN="$WORK/data-bin/$TOKENIZE"
if [[ ! -f "$BIN/dict.txt" ]]; then
  say "binarising with fairseq-preprocess --only-source"
  rm -rf "$BIN.tmp"
  "$(tool fairseq-preprocess)" --only-source --trainpref "$TOK/train.txt" --validpref "$TOK/valid.txt" \
    --testpref "$TOK/test.txt" --destdir "$BIN.tmp" --nwordssrc "$NWORDS" --workers "$WORKERS"
  mv "$BIN.tmp" "$BIN"
fi
say "vocabulary: $(wc -l < "$BIN/dict.txt") types (+4 specials) in $BIN/dict.txt"

# ---------------------------------------------------------------- 3. train
# model, data and criterion: read by both launchers
TRAIN_ARGS=("$BIN" --user-dir "$ROOT/user_dir" --task language_modeling "${MODEL_ARGS[@]}"
            --share-decoder-input-output-embed
            --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none
            --max-tokens "$MAX_TOKENS" --max-update "$MAX_UPDATE" --save-dir "$SAVE_DIR"
            --seed 1 --log-format simple --log-interval "$LOG_INTERVAL" "${DEVICE_ARGS[@]}")
# fairseq's optimizer and schedule (the DeepSpeed launcher takes them from DS_CONFIG)
FAIRSEQ_ARGS=(--optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 0.0
              --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
              --update-freq "$UPDATE_FREQ" --ddp-backend "$DDP_BACKEND" "${FP16_ARGS[@]}")
# shellcheck disable=SC2206  # EXTRA_ARGS / LAUNCH_ARGS are word-split on purpose
EXTRA=($EXTRA_ARGS); LAUNCH=($LAUNCH_ARGS)

say "training ${MODEL_ARGS[1]} ($MODEL) on $NGPUS $([[ $CPU == 1 ]] && echo 'CPU ranks' || echo GPUs) with $LAUNCHER, $MAX_UPDATE updates -> $SAVE_DIR"
if [[ "$LAUNCHER" == torchrun ]]; then
  "$(tool torchrun)" --nproc_per_node "$NGPUS" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" "${LAUNCH[@]}" \
    "$(tool fairseq-train)" "${TRAIN_ARGS[@]}" "${FAIRSEQ_ARGS[@]}" "${EXTRA[@]}"
else  # also on CPU ranks (DS_ACCELERATOR=cpu): --num_gpus is the number of local ranks
  "$(tool deepspeed)" --num_gpus "$NGPUS" --master_addr 127.0.0.1 --master_port "$MASTER_PORT" "${LAUNCH[@]}" \
    --module embrace_fairseq.deepspeed_adapter.train "${TRAIN_ARGS[@]}" "${EXTRA[@]}" --deepspeed-config "$DS_CONFIG"
fi

# ---------------------------------------------------------------- 4. perplexity
CKPT="$SAVE_DIR/checkpoint_best.pt"          # both launchers validate (fairseq's loop)
[[ -f "$CKPT" ]] || CKPT="$SAVE_DIR/checkpoint_last.pt"
[[ -f "$CKPT" ]] || die "training wrote no checkpoint in $SAVE_DIR"
say "scoring test with $CKPT (perplexity per $([[ $TOKENIZE == spm ]] && echo 'sentencepiece piece' || echo word))"
# --required-batch-size-multiple 1: this fairseq build drops a last batch that is not a
# multiple of it (8 by default), which would leave test blocks out
"$(tool fairseq-eval-lm)" "$BIN" --user-dir "$ROOT/user_dir" --path "$CKPT" --gen-subset test \
  --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none --context-window "$CONTEXT_WINDOW" \
  --batch-size "$EVAL_BATCH_SIZE" --required-batch-size-multiple 1 "${EVAL_DEVICE_ARGS[@]}" \
  2>&1 | tee "$SAVE_DIR/eval-lm-test.txt"
grep -q "Perplexity:" "$SAVE_DIR/eval-lm-test.txt" || die "fairseq-eval-lm printed no perplexity (see $SAVE_DIR/eval-lm-test.txt)"
say "done: $CKPT, $(grep -o 'Loss (base 2): .*' "$SAVE_DIR/eval-lm-test.txt" | tail -1)"
