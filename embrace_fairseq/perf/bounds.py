"""Analytic minimum of the bytes each strategy must send per rank per step.

Benchmarks divide what the ledger (or the NIC) measured by these figures: a ratio
near 1 says an implementation sends what its strategy needs and no more; the
difference is protocol overhead (headers, padding, wider id types) or waste.

Conventions (DESIGN.md, "Volume per rank per step"):

* bytes *sent* per rank per step, averaged over the ranks (what one NIC carries out;
  in a ring or an AlltoAll every rank also receives about as much);
* ring collectives, which are bandwidth-optimal: an all-reduce of ``M`` bytes sends
  ``2 (N-1)/N M`` per rank (reduce-scatter then all-gather), an all-gather of blocks
  ``b_1..b_N`` sends ``(N-1)/N sum(b)`` per rank on average, a reduce-scatter as much;
* exact for the given ids: unique ids and owners are counted, not estimated;
* one table of ``vocab x dim`` rows shared by all lookups of a step (a tied
  encoder/decoder table is read through one exchange); ``dense_numel`` counts every
  other trainable element (replicated, all-reduced).

Kinds match :mod:`embrace_fairseq.core.ledger`: ``counts``, ``ids``, ``rows``,
``grad_rows``, ``table_gather``, ``table_grad``, ``dense_grad``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, ShardPlan

STRATEGIES = (
    "fairseq_legacy_ddp",
    "fairseq_c10d",
    "deepspeed",
    "sparse_allgather",
    "embrace_noschedule",
    "embrace_schedule",
)
TIED_OUTPUT = (None, "gather")


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def ring_allgather_bytes(total_nbytes: float, world_size: int) -> float:
    """Average bytes one rank sends in a ring all-gather whose blocks add up to
    ``total_nbytes``: every rank forwards all blocks but one, ``(N-1)/N total``."""
    return (world_size - 1) / world_size * total_nbytes if world_size > 1 else 0.0


def off_owner_unique_ids(ids_per_rank: Sequence[torch.Tensor], plan: ShardPlan) -> List[int]:
    """For each rank, how many of its unique ids other ranks own (what it must ask for)."""
    out = []
    for rank, ids in enumerate(ids_per_rank):
        u = torch.unique(ids.reshape(-1).long())
        out.append(int((plan.owner(u) != rank).sum()))  # any layout
    return out


def unique_counts(ids_per_rank: Sequence[torch.Tensor]) -> List[int]:
    return [int(torch.unique(ids.reshape(-1)).numel()) for ids in ids_per_rank]


def min_bytes_per_step(
    strategy: str,
    *,
    world_size: int,
    vocab: int,
    dim: int,
    dense_numel: int,
    ids_per_rank: Sequence[torch.Tensor],
    element_size: int = 4,
    id_size: int = 4,
    tied_output: Optional[str] = None,
    exchanges_per_step: int = 1,
    layout: str = DEFAULT_LAYOUT,
) -> Dict[str, float]:
    """Minimum bytes sent per rank per step, by kind, averaged over ranks; key ``total``.

    Args:
        strategy: one of :data:`STRATEGIES`.
        world_size: N data-parallel ranks.
        vocab, dim: the embedding table (V x D).
        dense_numel: trainable elements outside the table (replicated everywhere).
        ids_per_rank: the ids each rank looks up in the step (all lookups of the table
            together), one tensor per rank.
        element_size: bytes per gradient / weight element (4 for fp32, 2 for fp16).
        id_size: bytes per id on the wire (4: int32 holds any vocab below 2**31).
        tied_output: ``None`` (no output projection reads the table, or it is untied
            and so part of ``dense_numel``) or ``"gather"``: a tied output projection
            reads the full table.
        exchanges_per_step: AlltoAll exchanges per step (each sends one header).
        layout: the tables' shard layout (which ids are local to which rank).

    What each strategy must send (``e`` = element_size, U_r = unique ids of rank r):

    * ``fairseq_legacy_ddp``, ``fairseq_c10d``, ``deepspeed`` (ZeRO-0): every gradient
      is all-reduced, sparsity is ignored: ``table_grad`` = ring all-reduce of V·D·e,
      ``dense_grad`` = ring all-reduce of dense·e. A tied projection changes nothing
      (one parameter, one gradient). Minimal for the strategy; bucketing (fairseq's
      flat buffers, DDP buckets) does not change the volume.
    * ``sparse_allgather`` (``nn.Embedding(sparse=True)`` under DeepSpeed): every rank
      all-gathers every rank's coalesced gradient, ``ids`` = (N-1)/N · Σ_r U_r·id_size,
      ``grad_rows`` = (N-1)/N · Σ_r U_r·D·e, i.e. (N-1)·mean(U)·(D·e+id_size);
      ``counts`` = all-gather of one size per rank, (N-1)/N · N · 8 bytes (int64, as
      DeepSpeed does) per gather, two gathers (indices, values). Protocol overhead not
      counted: DeepSpeed pads every rank's block to the largest one and sends int64
      indices (``id_size=8`` reproduces that part). With a tied projection the table
      gradient is dense, so the table is all-reduced as in DDP (``table_grad``).
    * ``embrace_noschedule``, ``embrace_schedule`` (same bytes; the schedule only
      reorders): with the :class:`ShardPlan` of ``layout``, M = Σ_r (unique ids of rank r
      owned by another rank); per rank on average ``ids`` = M·id_size/N,
      ``rows`` = M·D·e/N (owners send the rows back), ``grad_rows`` = M·D·e/N (the
      gradient of each unique row goes to its owner once). These three are the
      minimum for any lookup by owner: a row not held locally must cross a link once
      each way, and its id must reach the owner. ``counts``: one id_size count per
      peer per exchange, (N-1)·id_size — protocol overhead, the least a receiver needs
      to size its buffer (the implementation's header holds three int64 per peer,
      count plus an error flag and the offending id: 24 bytes per peer).
      ``dense_grad`` = ring all-reduce of dense·e. With a tied projection
      (``tied_output="gather"``): ``table_gather`` = (N-1)/N·V·D·e and ``table_grad``
      (reduce-scatter) = (N-1)/N·V·D·e, together exactly the table's all-reduce; the
      implementation pads shards to the largest for gloo's all-gather, which adds
      (N-1)·(ceil(V/N) - V/N)·D·e, protocol overhead not counted here. A tighter
      design exists for the tied case: lookups could read the gathered table and fold
      their gradient rows into its reduce-scatter, saving ids/rows/grad_rows; the
      figure returned follows the design (exchange for lookups, gather for the
      projection), so it bounds what this design can send.

    ``total`` is the sum of the kinds. A world of one sends nothing.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if tied_output not in TIED_OUTPUT:
        raise ValueError(f"tied_output must be None or 'gather', got {tied_output!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(ids_per_rank) != world_size:
        raise ValueError(f"ids_per_rank holds {len(ids_per_rank)} tensors for a world of {world_size} ranks")
    if vocab < 1 or dim < 1 or dense_numel < 0:
        raise ValueError(f"need vocab >= 1, dim >= 1, dense_numel >= 0 (got {vocab}, {dim}, {dense_numel})")
    for r, ids in enumerate(ids_per_rank):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"ids of rank {r} fall outside [0, {vocab})")

    n = world_size
    table_bytes = float(vocab) * dim * element_size
    dense_bytes = float(dense_numel) * element_size
    out: Dict[str, float] = {}
    if n == 1:
        out["total"] = 0.0
        return out

    if strategy in ("fairseq_legacy_ddp", "fairseq_c10d", "deepspeed"):
        out[K.TABLE_GRAD] = ring_allreduce_bytes(table_bytes, n)
        out[K.DENSE_GRAD] = ring_allreduce_bytes(dense_bytes, n)
    elif strategy == "sparse_allgather":
        if tied_output == "gather":
            out[K.TABLE_GRAD] = ring_allreduce_bytes(table_bytes, n)
        else:
            sum_unique = float(sum(unique_counts(ids_per_rank)))
            out[K.COUNTS] = 2 * ring_allgather_bytes(n * 8.0, n)
            out[K.IDS] = ring_allgather_bytes(sum_unique * id_size, n)
            out[K.GRAD_ROWS] = ring_allgather_bytes(sum_unique * dim * element_size, n)
        out[K.DENSE_GRAD] = ring_allreduce_bytes(dense_bytes, n)
    else:  # embrace
        plan = ShardPlan(vocab, n, layout)
        m = float(sum(off_owner_unique_ids(ids_per_rank, plan)))
        out[K.COUNTS] = float(exchanges_per_step * (n - 1) * id_size)
        out[K.IDS] = m * id_size / n
        out[K.ROWS] = m * dim * element_size / n
        out[K.GRAD_ROWS] = m * dim * element_size / n
        if tied_output == "gather":
            out[K.TABLE_GATHER] = ring_allgather_bytes(table_bytes, n)
            out[K.TABLE_GRAD] = ring_allgather_bytes(table_bytes, n)
        out[K.DENSE_GRAD] = ring_allreduce_bytes(dense_bytes, n)
    out["total"] = float(sum(out.values()))
    return out
