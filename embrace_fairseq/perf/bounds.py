"""Analytic minimum of the bytes each strategy must send per rank per step.

Benchmarks divide what the ledger (or the NIC) measured by these figures: a ratio
near 1 says an implementation sends what its strategy needs and no more; the
difference is protocol overhead (headers, padding, wider id types) or waste.

Conventions (docs/DESIGN.md, "Volume per rank per step"):

* bytes *sent* per rank per step, averaged over the ranks (what one NIC carries out;
  in a ring or an AlltoAll every rank also receives about as much);
* ring collectives (:mod:`embrace_fairseq.core.ring_volume`): an all-reduce of ``M``
  bytes sends ``2 (N-1)/N M`` per rank, an all-gather or a reduce-scatter ``(N-1)/N M``;
* exact for the given ids: unique ids and owners are counted, not estimated;
* one table of ``vocab x dim`` rows shared by all lookups of a step (a tied
  encoder/decoder table is read through one exchange); ``dense_numel`` counts every
  other trainable element (replicated, all-reduced).

Kinds match :mod:`embrace_fairseq.core.ledger`: ``counts``, ``ids``, ``rows``,
``grad_rows``, ``table_gather``, ``table_grad``, ``dense_grad``. The formula of each
strategy is registered with it (:mod:`embrace_fairseq.perf.strategies`, written in
:mod:`embrace_fairseq.planner.volume`); this module checks the inputs and counts the ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Sequence

import torch

from embrace_fairseq.core.ring_volume import ring_allgather_bytes, ring_allreduce_bytes  # noqa: F401  (re-exported)
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, ShardPlan
from embrace_fairseq.perf.strategies import STRATEGIES, get_strategy  # noqa: F401  (re-exported)

TIED_OUTPUT = (None, "gather", "vocab_parallel")


def off_owner_unique_ids(ids_per_rank: Sequence[torch.Tensor], plan: ShardPlan) -> List[int]:
    """For each rank, how many of its unique ids other ranks own (what it must ask for)."""
    out = []
    for rank, ids in enumerate(ids_per_rank):
        u = torch.unique(ids.reshape(-1).long())
        out.append(int((plan.owner(u) != rank).sum()))  # any layout
    return out


def unique_counts(ids_per_rank: Sequence[torch.Tensor]) -> List[int]:
    return [int(torch.unique(ids.reshape(-1)).numel()) for ids in ids_per_rank]


@dataclass(frozen=True)
class StepIds:
    """A :class:`embrace_fairseq.planner.volume.StepTraffic` from the ids of one step;
    unique ids are counted (exactly) only when a formula reads them."""

    world_size: int
    vocab: int
    dim: int
    dense_numel: int
    ids_per_rank: Sequence[torch.Tensor]
    element_size: int
    id_size: int
    tied_output: Optional[str]
    exchanges_per_step: int
    layout: str = DEFAULT_LAYOUT
    tokens_per_rank: Optional[Sequence[int]] = None

    @property
    def table_bytes(self) -> float:
        return float(self.vocab) * self.dim * self.element_size

    @property
    def dense_bytes(self) -> float:
        return float(self.dense_numel) * self.element_size

    @cached_property
    def unique_total(self) -> float:
        return float(sum(unique_counts(self.ids_per_rank)))

    @cached_property
    def off_owner_total(self) -> float:
        return float(sum(off_owner_unique_ids(self.ids_per_rank, ShardPlan(self.vocab, self.world_size, self.layout))))


def _check(step: StepIds) -> None:
    if step.tied_output not in TIED_OUTPUT:
        raise ValueError(f"tied_output must be None, 'gather' or 'vocab_parallel', got {step.tied_output!r}")
    if step.tied_output == "vocab_parallel" and (step.tokens_per_rank is None
                                                 or len(step.tokens_per_rank) != step.world_size):
        raise ValueError("tied_output='vocab_parallel' needs tokens_per_rank, one count per rank")
    if step.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {step.world_size}")
    if len(step.ids_per_rank) != step.world_size:
        raise ValueError(f"ids_per_rank holds {len(step.ids_per_rank)} tensors for a world of {step.world_size} ranks")
    if step.vocab < 1 or step.dim < 1 or step.dense_numel < 0:
        raise ValueError(f"need vocab >= 1, dim >= 1, dense_numel >= 0 "
                         f"(got {step.vocab}, {step.dim}, {step.dense_numel})")
    for r, ids in enumerate(step.ids_per_rank):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= step.vocab):
            raise ValueError(f"ids of rank {r} fall outside [0, {step.vocab})")


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
    tokens_per_rank: Optional[Sequence[int]] = None,
) -> Dict[str, float]:
    """Minimum bytes sent per rank per step, by kind, averaged over ranks; key ``total``.

    Args:
        strategy: a registered strategy (:data:`STRATEGIES`) or an alias of one.
        world_size: N data-parallel ranks.
        vocab, dim: the embedding table (V x D).
        dense_numel: trainable elements outside the table (replicated everywhere).
        ids_per_rank: the ids each rank looks up in the step (all lookups of the table
            together), one tensor per rank.
        element_size: bytes per gradient / weight element (4 for fp32, 2 for fp16).
        id_size: bytes per id on the wire (4: int32 holds any vocab below 2**31).
        tied_output: ``None`` (no output projection reads the table, or it is untied
            and so part of ``dense_numel``) or ``"gather"``: a tied output projection
            reads the full table (all-gather and reduce-scatter), or ``"vocab_parallel"``:
            it is computed vocab-parallel (activations move instead of the table).
        exchanges_per_step: AlltoAll exchanges per step (each sends one header).
        layout: the tables' shard layout (which ids are local to which rank).
        tokens_per_rank: target tokens of each rank (needed by ``"vocab_parallel"``).

    What each strategy must send is the strategy's registered formula, documented in
    :mod:`embrace_fairseq.planner.volume`. ``total`` is the sum of the kinds. A world of
    one sends nothing.
    """
    spec = get_strategy(strategy)
    step = StepIds(world_size, vocab, dim, dense_numel, ids_per_rank, element_size, id_size, tied_output,
                   exchanges_per_step, layout, tokens_per_rank)
    _check(step)
    if world_size == 1:
        return {"total": 0.0}
    out = spec.volume(step)
    out["total"] = float(sum(out.values()))
    return out
