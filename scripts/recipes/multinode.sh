#!/usr/bin/env bash
# Start EmbRace training on several nodes: run this script once on every node, with the
# same arguments except the node rank. It picks the network interface, builds the launch
# command, prints it and runs it. docs/MULTINODE.md explains each choice.
#
#   --launcher torchrun   static rendezvous, every node knows its rank:
#       torchrun --nnodes N --nproc-per-node K --node-rank I --master-addr NODE0 --master-port P
#   --launcher rdzv       torchrun's c10d rendezvous, ranks handed out as nodes join:
#       torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint NODE0:P --rdzv-id JOB
#   --launcher deepspeed  DeepSpeed's launcher, one per node, no ssh:
#       deepspeed --hostfile H --no_ssh --node_rank I --master_addr NODE0 --master_port P --module ...
#
# followed by fairseq-train (--trainer fairseq, torchrun launchers) or embrace-ds-train, the
# EmbRace DeepSpeed engine in fairseq's loop (--trainer deepspeed; always with --launcher
# deepspeed), with --user-dir user_dir and, for fairseq-train, --ddp-backend legacy_ddp
# unless the training arguments choose one.
#
# Usage:
#   scripts/recipes/multinode.sh [options] DATA_BIN [training args...]
# e.g. on node 0 and node 1 (node 0's address as the other nodes reach it: 10.0.0.1):
#   scripts/recipes/multinode.sh --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 \
#       /shared/data-bin --task translation --arch embrace_transformer_wmt_en_de --share-all-embeddings \
#       --max-tokens 4096 --optimizer adam --lr 7e-4 --save-dir /shared/checkpoints/run1
#   scripts/recipes/multinode.sh --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 8 /shared/data-bin ...
#
# Options (each also an environment variable, in brackets with its default):
#   --launcher torchrun|rdzv|deepspeed  [LAUNCHER, torchrun]
#   --trainer fairseq|deepspeed         [TRAINER, fairseq; deepspeed with --launcher deepspeed]
#   --nnodes N                          [NNODES, 2; rdzv also takes MIN:MAX]
#   --nproc-per-node K                  [NPROC_PER_NODE; the GPUs of this node, CPU=1: 2]
#   --node-rank I                       [NODE_RANK; required by torchrun and deepspeed, not by rdzv]
#   --master-addr ADDR                  [MASTER_ADDR; required: node 0's address (rdzv: the endpoint host)]
#   --master-port P                     [MASTER_PORT, 29500]
#   --rdzv-id JOB                       [RDZV_ID, embrace; the same on every node of one job]
#   --ifname IF                         [IFNAME; the interface that carries this node's address to
#                                        the others: the one holding MASTER_ADDR on node 0, the one
#                                        routing to it elsewhere. Sets GLOO_SOCKET_IFNAME and
#                                        NCCL_SOCKET_IFNAME unless those are set]
#   --hostfile FILE                     [HOSTFILE; deepspeed: "name slots=K" per node, node 0 first;
#                                        written to $TMPDIR if not given]
#   --dry-run                           [DRY_RUN=1: print the command, run nothing]
# Environment only:
#   CPU=1          CPU ranks: gloo, --cpu, DS_ACCELERATOR=cpu
#   DS_CONFIG      DeepSpeed JSON [ds_config/embrace_fp16_gpu.json; CPU=1: ds_config/embrace_cpu.json]
#   LAUNCH_ARGS    extra launcher arguments, word-split (e.g. "--max-restarts 3") [none]
#   EMBRACE_PEER_TIMEOUT_S  seconds before a silent peer counts as lost [60]
#   EMBRACE_VENV   environment with fairseq, torch and deepspeed [$ROOT/.venv, else PATH]
#
# DATA_BIN and --save-dir must be paths every node sees (shared storage): every rank reads
# the data, rank 0 alone writes checkpoints, and on a resume every node checks that
# checkpoint_last.pt exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

die() { echo "multinode.sh: $*" >&2; exit 2; }
say() { echo "[multinode] $*"; }

LAUNCHER="${LAUNCHER:-torchrun}"
TRAINER="${TRAINER:-}"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-}"
NODE_RANK="${NODE_RANK:-}"
MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-embrace}"
IFNAME="${IFNAME:-}"
HOSTFILE="${HOSTFILE:-}"
DRY_RUN="${DRY_RUN:-0}"
CPU="${CPU:-0}"
LAUNCH_ARGS="${LAUNCH_ARGS:-}"
VENV="${EMBRACE_VENV:-$ROOT/.venv}"

# ---------------------------------------------------------------- options
while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) LAUNCHER="${2:?--launcher needs a value}"; shift 2 ;;
    --trainer) TRAINER="${2:?--trainer needs a value}"; shift 2 ;;
    --nnodes) NNODES="${2:?--nnodes needs a value}"; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE="${2:?--nproc-per-node needs a value}"; shift 2 ;;
    --node-rank) NODE_RANK="${2:?--node-rank needs a value}"; shift 2 ;;
    --master-addr) MASTER_ADDR="${2:?--master-addr needs a value}"; shift 2 ;;
    --master-port) MASTER_PORT="${2:?--master-port needs a value}"; shift 2 ;;
    --rdzv-id) RDZV_ID="${2:?--rdzv-id needs a value}"; shift 2 ;;
    --ifname) IFNAME="${2:?--ifname needs a value}"; shift 2 ;;
    --hostfile) HOSTFILE="${2:?--hostfile needs a value}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (launcher options come before DATA_BIN; see --help)" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || die "usage: $0 [options] DATA_BIN [training args...] (see --help)"
DATA="$1"; shift

case "$LAUNCHER" in torchrun|rdzv|deepspeed) ;; *) die "--launcher must be torchrun, rdzv or deepspeed, got '$LAUNCHER'" ;; esac
[[ -n "$TRAINER" ]] || TRAINER=$([[ "$LAUNCHER" == deepspeed ]] && echo deepspeed || echo fairseq)
case "$TRAINER" in fairseq|deepspeed) ;; *) die "--trainer must be fairseq or deepspeed, got '$TRAINER'" ;; esac
[[ "$LAUNCHER" != deepspeed || "$TRAINER" == deepspeed ]] || die "--launcher deepspeed starts embrace-ds-train only (--trainer deepspeed)"
[[ -n "$MASTER_ADDR" ]] || die "set --master-addr (MASTER_ADDR): node 0's address, as the other nodes reach it"
if [[ "$LAUNCHER" != rdzv ]]; then
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || die "set --node-rank (NODE_RANK): 0 on the master node, 1..NNODES-1 on the others"
  [[ "$NNODES" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] || die "--node-rank $NODE_RANK is not below --nnodes $NNODES"
fi
if [[ -z "$NPROC_PER_NODE" ]]; then
  if [[ "$CPU" == 1 ]]; then NPROC_PER_NODE=2
  else NPROC_PER_NODE="$( (nvidia-smi -L 2>/dev/null || true) | wc -l)"; fi
fi
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "no GPU found (nvidia-smi -L): set --nproc-per-node, or CPU=1 for CPU ranks"

# tools from the EmbRace environment, else from PATH
tool() {
  if [[ -x "$VENV/bin/$1" ]]; then echo "$VENV/bin/$1"
  elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
  else die "'$1' not found in $VENV/bin nor on PATH: run scripts/setup.sh or set EMBRACE_VENV"; fi
}
PY="$(tool python)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # --user-dir user_dir imports embrace_fairseq

# ---------------------------------------------------------------- network interface
# An IPv4 address for a host name (the address itself when it is one).
ipv4_of() { getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 { print $1 }' || true; }
MASTER_IP="$(ipv4_of "$MASTER_ADDR")"; MASTER_IP="${MASTER_IP:-$MASTER_ADDR}"
# Node 0 holds the master address: its interface (the route to an own address is lo, which the
# other nodes cannot reach). Any other node: the interface its route to node 0 leaves by.
MASTER_HERE="$(ip -o -4 addr show to "$MASTER_IP/32" 2>/dev/null | awk 'NR == 1 { print $2 }' || true)"
if [[ -z "$IFNAME" ]]; then
  IFNAME="$MASTER_HERE"
  [[ -n "$IFNAME" ]] || IFNAME="$(ip -o route get "$MASTER_IP" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n 1 || true)"
  [[ -n "$IFNAME" ]] || die "no route to $MASTER_ADDR ($MASTER_IP) from this node: check the address, or set --ifname"
fi
ip link show dev "$IFNAME" >/dev/null 2>&1 || die "no interface '$IFNAME' on this node (ip -br addr lists them)"
LOCAL_ADDR="$(ip -o -4 addr show dev "$IFNAME" 2>/dev/null | awk 'NR == 1 { split($4, a, "/"); print a[1] }' || true)"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$IFNAME}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$IFNAME}"

# ---------------------------------------------------------------- training command
ARGS=("$DATA" "$@")
has() { local f; for f in "${ARGS[@]}"; do [[ "$f" == "$1" || "$f" == "$1="* ]] && return 0; done; return 1; }
has --user-dir || ARGS+=(--user-dir "$ROOT/user_dir")
if [[ "$CPU" == 1 ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" DS_ACCELERATOR=cpu
  has --cpu || ARGS+=(--cpu)
  [[ "$TRAINER" == deepspeed ]] || has --distributed-backend || ARGS+=(--distributed-backend gloo)
fi
if [[ "$TRAINER" == fairseq ]]; then
  has --ddp-backend || ARGS+=(--ddp-backend legacy_ddp)
  TRAIN=("$(tool fairseq-train)")
else
  DS_CONFIG="${DS_CONFIG:-$ROOT/ds_config/$([[ "$CPU" == 1 ]] && echo embrace_cpu.json || echo embrace_fp16_gpu.json)}"
  [[ -f "$DS_CONFIG" ]] || die "DeepSpeed config $DS_CONFIG not found"
  has --deepspeed-config || ARGS+=(--deepspeed-config "$DS_CONFIG")
  TRAIN=("$PY" -m embrace_fairseq.deepspeed_adapter.train)
fi

# shellcheck disable=SC2206  # LAUNCH_ARGS is word-split on purpose
LAUNCH=($LAUNCH_ARGS)
case "$LAUNCHER" in
  torchrun)
    CMD=("$(tool torchrun)" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK"
         --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "${LAUNCH[@]}" --no-python "${TRAIN[@]}" "${ARGS[@]}") ;;
  rdzv)
    # torchrun guesses which node hosts the rendezvous store from the host name; an endpoint
    # on another interface (a second NIC) defeats the guess, so say it. --local-addr: the
    # address the workers of the rank-0 agent are reached at (the host name otherwise).
    IS_HOST=$([[ -n "$MASTER_HERE" ]] && echo 1 || echo 0)
    CMD=("$(tool torchrun)" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d
         --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" --rdzv-conf "is_host=$IS_HOST"
         ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} "${LAUNCH[@]}" --no-python "${TRAIN[@]}" "${ARGS[@]}") ;;
  deepspeed)
    if [[ -z "$HOSTFILE" ]]; then
      # with --no_ssh the names are labels only: the order gives the node ranks, slots the ranks per node
      HOSTFILE="${TMPDIR:-/tmp}/embrace_hostfile.$RDZV_ID.$NNODES.$NPROC_PER_NODE"
      tmp_hosts="$(mktemp "$HOSTFILE.XXXXXX")"   # renamed into place: a launcher never reads half a file
      for ((n = 0; n < NNODES; n++)); do echo "node$n slots=$NPROC_PER_NODE"; done > "$tmp_hosts"
      mv -f "$tmp_hosts" "$HOSTFILE"
    fi
    [[ -f "$HOSTFILE" ]] || die "hostfile $HOSTFILE not found"
    # the runner's --module takes the module in place of a script
    CMD=("$PY" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK"
         --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "${LAUNCH[@]}"
         --module embrace_fairseq.deepspeed_adapter.train "${ARGS[@]}") ;;
esac

say "node ${NODE_RANK:-(rendezvous)} of $NNODES, $NPROC_PER_NODE ranks, $LAUNCHER + $([[ $TRAINER == fairseq ]] && echo fairseq-train || echo embrace-ds-train)"
say "interface $IFNAME (${LOCAL_ADDR:-no IPv4 address}): GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME; EMBRACE_PEER_TIMEOUT_S=${EMBRACE_PEER_TIMEOUT_S:-60}"
say "running: $(printf '%q ' "${CMD[@]}")"
[[ "$DRY_RUN" == 1 ]] && exit 0
exec "${CMD[@]}"
