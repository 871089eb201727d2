"""What each strategy must send per rank per step, by ledger kind (the formulas).

One function per family of strategies; :mod:`embrace_fairseq.perf.strategies`
registers them under the strategies' names and :func:`embrace_fairseq.perf.bounds.
min_bytes_per_step` validates its inputs, counts the ids and calls them. Conventions
in :mod:`embrace_fairseq.perf.bounds`; ``e`` = element size, ``U_r`` = unique ids of
rank ``r``. Pure arithmetic: the counts come in through :class:`StepTraffic` (the
bounds count them with torch, only for the strategies that read them). The planner's
cost model (:mod:`embrace_fairseq.planner.cost`) prices each table's choice with them.

Key order matters: ``total`` is the sum of the values in insertion order.
"""
from __future__ import annotations

from typing import Dict, Optional, Protocol, Sequence

from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ring_volume import ring_allgather_bytes, ring_allreduce_bytes, ring_reduce_scatter_bytes

# DeepSpeed gathers one int64 size per rank, twice (indices, values)
SPARSE_SIZE_BYTES = 8.0
SPARSE_SIZE_GATHERS = 2


class StepTraffic(Protocol):
    """One step of one table: its sizes and (lazily counted) the ids the ranks look up."""

    world_size: int
    dim: int
    element_size: int
    id_size: int
    tied_output: Optional[str]  # None, "gather" or "vocab_parallel"
    exchanges_per_step: int
    tokens_per_rank: Optional[Sequence[int]]  # target tokens of each rank ("vocab_parallel")

    @property
    def table_bytes(self) -> float: ...

    @property
    def dense_bytes(self) -> float: ...

    @property
    def unique_total(self) -> float:
        """Sum over ranks of the unique ids each rank looks up."""

    @property
    def off_owner_total(self) -> float:
        """Sum over ranks of the unique ids each rank looks up that another rank owns."""


def dense_allreduce(step: StepTraffic) -> Dict[str, float]:
    """fairseq ``legacy_ddp``, ``c10d``, DeepSpeed ZeRO-0: every gradient is all-reduced,
    sparsity ignored: ``table_grad`` = ring all-reduce of V·D·e, ``dense_grad`` = ring
    all-reduce of dense·e. A tied projection changes nothing (one parameter, one
    gradient); bucketing (flat buffers, DDP buckets) does not change the volume."""
    n = step.world_size
    return {K.TABLE_GRAD: ring_allreduce_bytes(step.table_bytes, n),
            K.DENSE_GRAD: ring_allreduce_bytes(step.dense_bytes, n)}


def nothing(step: StepTraffic) -> Dict[str, float]:
    """The compute-only floor: the same steps with no communication at all."""
    return {}


def zero_partitioned(step: StepTraffic) -> Dict[str, float]:
    """DeepSpeed ZeRO stage 1 or 2: each rank needs the sum of its partition of every
    gradient (``table_grad``, ``dense_grad``: ring reduce-scatter, (N-1)/N of the
    payload) and, after stepping its partition, every other rank's updated partition
    (``param_gather``: ring all-gather of the parameters). Together the volume of an
    all-reduce; DeepSpeed's default reduction (``use_multi_rank_bucket_allreduce``)
    all-reduces the buckets instead, (N-1)/N more, which the counted bytes show."""
    n = step.world_size
    return {K.TABLE_GRAD: ring_reduce_scatter_bytes(step.table_bytes, n),
            K.DENSE_GRAD: ring_reduce_scatter_bytes(step.dense_bytes, n),
            K.PARAM_GATHER: ring_allgather_bytes(step.table_bytes + step.dense_bytes, n)}


def sparse_allgather(step: StepTraffic) -> Dict[str, float]:
    """``nn.Embedding(sparse=True)`` under DeepSpeed: every rank all-gathers every rank's
    coalesced gradient, ``ids`` = (N-1)/N · Σ_r U_r·id_size, ``grad_rows`` = (N-1)/N ·
    Σ_r U_r·D·e, i.e. (N-1)·mean(U)·(D·e+id_size); ``counts`` = all-gather of one int64
    size per rank, twice (indices, values). Not counted (protocol overhead): DeepSpeed
    pads every block to the largest and sends int64 indices (``id_size=8`` gives that
    part). With a tied projection the table gradient is dense: all-reduced as in DDP."""
    n = step.world_size
    out: Dict[str, float] = {}
    if step.tied_output == "gather":
        out[K.TABLE_GRAD] = ring_allreduce_bytes(step.table_bytes, n)
    else:
        sum_unique = step.unique_total
        out[K.COUNTS] = SPARSE_SIZE_GATHERS * ring_allgather_bytes(n * SPARSE_SIZE_BYTES, n)
        out[K.IDS] = ring_allgather_bytes(sum_unique * step.id_size, n)
        out[K.GRAD_ROWS] = ring_allgather_bytes(sum_unique * step.dim * step.element_size, n)
    out[K.DENSE_GRAD] = ring_allreduce_bytes(step.dense_bytes, n)
    return out


def vocab_parallel_output(step: StepTraffic) -> Dict[str, float]:
    """The vocab-parallel output layer under cross entropy, ``T_r`` target tokens on rank
    ``r``, ``M = sum T_r``: each rank sends its hidden states to every other rank
    (``hidden_gather`` = (N-1)·T_r·D·e) and the rows of the others' tokens of its
    hidden-state gradient to their owners (``hidden_grad`` = (M-T_r)·D·e); averaged over
    ranks both are (N-1)·mean(T)·D·e. ``softmax_stats``: a count to each peer (8 bytes),
    the targets (id_size) to each peer, three floats per token (local max, sum of
    exponentials, the target's logit) from every shard to the token's owner, and in
    backward the upstream per-token gradient and ``logZ`` (two floats) to each peer.
    Label smoothing (one more float per token each way) and accuracy (one more in
    forward) are not counted: the benchmark's criterion uses neither."""
    n = step.world_size
    tokens = list(step.tokens_per_rank or [])
    m = float(sum(tokens))
    per_peer = (n - 1) * m / n  # mean over ranks of (N-1)·T_r
    row = step.dim * step.element_size
    return {
        K.SOFTMAX_STATS: (n - 1) * 8.0 + per_peer * (step.id_size + 2 * 4) + per_peer * 3 * 4,
        K.HIDDEN_GATHER: per_peer * row,
        K.HIDDEN_GRAD: per_peer * row,
    }


def embrace_exchange(step: StepTraffic) -> Dict[str, float]:
    """EmbRace, with or without the schedule (it only reorders): with the contiguous
    ShardPlan, M = Σ_r (unique ids of rank r owned by another rank); per rank on average
    ``ids`` = M·id_size/N, ``rows`` = M·D·e/N (owners send the rows back), ``grad_rows``
    = M·D·e/N (each unique row's gradient goes to its owner once): the minimum for any
    lookup by owner. ``counts``: one id_size count per peer per exchange, the least a
    receiver needs to size its buffer (the implementation's header holds three int64
    per peer). ``dense_grad`` = ring all-reduce of dense·e. A tied projection
    (``"gather"``) adds ``table_gather`` and ``table_grad`` (reduce-scatter), (N-1)/N·
    V·D·e each, together the table's all-reduce (gloo's padding of uneven shards not
    counted). A tighter tied design could fold lookups into the gathered table; the
    figure follows this design, so it bounds what this design can send. A tied
    projection read vocab-parallel (``"vocab_parallel"``) adds
    :func:`vocab_parallel_output` instead."""
    n = step.world_size
    m = step.off_owner_total
    out: Dict[str, float] = {
        K.COUNTS: float(step.exchanges_per_step * (n - 1) * step.id_size),
        K.IDS: m * step.id_size / n,
        K.ROWS: m * step.dim * step.element_size / n,
        K.GRAD_ROWS: m * step.dim * step.element_size / n,
    }
    if step.tied_output == "gather":
        out[K.TABLE_GATHER] = ring_allgather_bytes(step.table_bytes, n)
        out[K.TABLE_GRAD] = ring_reduce_scatter_bytes(step.table_bytes, n)
    elif step.tied_output == "vocab_parallel":
        out.update(vocab_parallel_output(step))
    out[K.DENSE_GRAD] = ring_allreduce_bytes(step.dense_bytes, n)
    return out


def embrace_zero_partitioned(step: StepTraffic) -> Dict[str, float]:
    """EmbRace with the dense layers under DeepSpeed ZeRO stage 1: the exchange (and the
    tied output's traffic) of :func:`embrace_exchange`; the dense gradients as in
    :func:`zero_partitioned`, each rank's partition reduce-scattered (``dense_grad``) and
    the updated dense partitions all-gathered (``param_gather``). The table's rows are
    stepped where they live: nothing of the table is gathered."""
    n = step.world_size
    out = embrace_exchange(step)
    out[K.DENSE_GRAD] = ring_reduce_scatter_bytes(step.dense_bytes, n)
    out[K.PARAM_GATHER] = ring_allgather_bytes(step.dense_bytes, n)
    return out
