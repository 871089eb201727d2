"""Input dist: the ids of a batch reach the ranks that own their rows.

Dedup the ids, bucket them by owner, AlltoAll a small header (counts and error
flags), then AlltoAll the ids. The result, an :class:`ExchangePlan`, is what the
output dist (rows back, gradient rows out) reuses.

The header doubles as the error channel: a rank that sees an invalid id still takes
part in the header AlltoAll, flagging the id, so *every* rank raises the same error
right after that collective instead of hanging in the next one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core import native_ops
from embrace_fairseq.core.ids import InvalidIdError, invalid_id_message
from embrace_fairseq.core.ledger import CommLedger, ledgers_for, off_rank, record_all
from embrace_fairseq.core.node_topology import NodeTopology
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.trace import mark_start

# Ids travel as int32 when the vocab fits: half the bytes of int64.
_INT32_LIMIT = 2**31 - 1
_HEADER_FIELDS = 3  # (count, has_bad_id, first_bad_id)


def wire_dtype(num_embeddings: int) -> torch.dtype:
    """The dtype ids travel in: int32 when the vocabulary fits (half the bytes of int64)."""
    return torch.int32 if num_embeddings <= _INT32_LIMIT else torch.long


@dataclass
class ExchangePlan:
    """What one forward exchange agreed on; the backward reuses it."""

    plan: ShardPlan
    group: Optional["dist.ProcessGroup"]
    rank: int
    unique_ids: torch.Tensor  # sorted unique plan-order ids this rank asked for (U,)
    inverse: torch.Tensor  # position in the flat batch -> index into unique_ids
    send_counts: List[int]  # how many unique ids this rank asks of each owner
    recv_counts: List[int]  # how many ids each requester asks of this rank
    requested_local: torch.Tensor  # local rows requested of this rank, by requester
    ledgers: List[CommLedger]
    # set by a table under the relaxed embedding dependency: its backward splits the rows
    relaxed: Optional[Any] = None
    table: Optional[Any] = None
    # the table's gradient-exchange scope (ShardedEmbedding.set_grad_exchange_scope): the
    # backward runs its exchange inside ``grad_scope()``, once per exchange
    grad_scope: Optional[Callable[[], ContextManager[None]]] = None
    # the job's nodes, when the table spans the whole job: says which bytes leave the node
    topology: Optional[NodeTopology] = None

    def off_node(self, counts: List[int]) -> Optional[int]:
        """How many of ``counts`` (one per rank) leave this rank's node (None: unknown)."""
        return None if self.topology is None else self.topology.off_node(counts, self.rank)


def plan_exchange(
    flat_ids: torch.Tensor,
    plan: ShardPlan,
    group: Optional["dist.ProcessGroup"],
    rank: int,
    ledger: Optional[CommLedger] = None,
    topology: Optional[NodeTopology] = None,
) -> ExchangePlan:
    """Dedup and bucket the ids, then AlltoAll the header and the ids.

    Collective: every rank of ``group`` must call it, also with an empty batch.
    ``topology``: the job's nodes when ``group`` is the whole job (for the ledger's
    inter-node bytes; the route is the same).
    Raises :class:`InvalidIdError` on every rank if any rank holds an invalid id.
    """
    if flat_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"embedding ids must be an integer tensor, got {flat_ids.dtype}")
    world = plan.world_size
    ledgers = ledgers_for(ledger)
    mark_start(ledgers)  # a traced exchange starts here, however the lookup was called
    device = flat_ids.device
    # ids in plan order, where every owner's rows are one contiguous block (nothing to do
    # for the contiguous layout); invalid ids pass unchanged and are found just below
    flat_ids = plan.to_plan(flat_ids)
    # validate, dedup (sorted: shards are contiguous blocks in plan order, so the unique
    # ids arrive grouped by owner) and count per owner; native_ops says how
    bucketed = native_ops.dedup_bucket(flat_ids, plan.boundaries)
    bad = bucketed.bad_id

    if bad is None:
        unique_ids, inverse, send_counts = bucketed.unique_ids, bucketed.inverse, bucketed.send_counts
    else:
        unique_ids = flat_ids.new_zeros(0, dtype=torch.long)
        inverse = flat_ids.new_zeros(0, dtype=torch.long)
        send_counts = [0] * world

    header = torch.zeros(world, _HEADER_FIELDS, dtype=torch.long, device=device)
    header[:, 0] = native_ops.host_ints(send_counts, device)  # no blocking host-to-device copy
    if bad is not None:
        header[:, 1] = 1
        header[:, 2] = bad
    recv_header = torch.empty_like(header)
    collectives.all_to_all_single(recv_header, header, group=group)
    header_bytes = (world - 1) * _HEADER_FIELDS * header.element_size()
    inter = None if topology is None else topology.off_node([_HEADER_FIELDS * header.element_size()] * world, rank)
    record_all(ledgers, K.COUNTS, header_bytes, header_bytes, inter)

    # one host sync for the whole header (kept: the counts are the ids' AlltoAll split
    # sizes, and raising on a flag is a host decision)
    received = recv_header.tolist()
    flagged = [r for r, row in enumerate(received) if row[1]]
    if flagged:
        src = flagged[0]
        raise InvalidIdError(
            invalid_id_message(int(received[src][2]), plan.num_embeddings, src)
            + (f" (raised on rank {rank} too, so no rank waits in a collective)" if src != rank else "")
        )
    recv_counts = [int(row[0]) for row in received]

    wire = wire_dtype(plan.num_embeddings)
    send_ids = unique_ids.to(wire)
    recv_ids = torch.empty(sum(recv_counts), dtype=wire, device=device)
    collectives.all_to_all_single(recv_ids, send_ids, recv_counts, send_counts, group)
    esize = send_ids.element_size()
    record_all(ledgers, K.IDS, off_rank(send_counts, rank) * esize, off_rank(recv_counts, rank) * esize,
               None if topology is None else topology.off_node(send_counts, rank) * esize)

    start, _ = plan.shard_range(rank)
    return ExchangePlan(
        plan=plan,
        group=group,
        rank=rank,
        unique_ids=unique_ids,
        inverse=inverse,
        send_counts=send_counts,
        recv_counts=recv_counts,
        requested_local=recv_ids.long() - start,
        ledgers=ledgers,
        topology=topology,
    )
