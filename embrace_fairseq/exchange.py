"""AlltoAll exchanges of a row-sharded table: the sparse half of hybrid communication.

Forward: dedup the ids, bucket them by owner, AlltoAll a small header (counts and
error flags), AlltoAll the ids, owners gather their rows, AlltoAll the rows back.
Backward mirrors it: the gradient rows of the unique ids go back to their owners,
which add them into the shard gradient.

The header doubles as the error channel: a rank that sees an invalid id still takes
part in the header AlltoAll, flagging the id, so *every* rank raises the same error
right after that collective instead of hanging in the next one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import comm_ledger as K
from . import native_ops
from .comm_ledger import CommLedger, global_ledger
from .shard_plan import ShardPlan
from .trace import TracingLedger

# Ids travel as int32 when the vocab fits: half the bytes of int64.
_INT32_LIMIT = 2**31 - 1
_HEADER_FIELDS = 3  # (count, has_bad_id, first_bad_id)


class InvalidIdError(ValueError):
    """An id outside ``[0, num_embeddings)`` reached a sharded table (on some rank)."""


def _record(ledgers: List[CommLedger], kind: str, sent: int, received: int) -> None:
    for ledger in ledgers:
        ledger.record(kind, sent, received)


def _ledgers(ledger: Optional[CommLedger]) -> List[CommLedger]:
    g = global_ledger()
    return [g] if ledger is None or ledger is g else [g, ledger]


def _off_rank(counts: List[int], rank: int) -> int:
    return sum(c for r, c in enumerate(counts) if r != rank)


@dataclass
class ExchangePlan:
    """What one forward exchange agreed on; the backward reuses it."""

    plan: ShardPlan
    group: Optional["dist.ProcessGroup"]
    rank: int
    unique_ids: torch.Tensor  # sorted unique ids this rank asked for (U,)
    inverse: torch.Tensor  # position in the flat batch -> index into unique_ids
    send_counts: List[int]  # how many unique ids this rank asks of each owner
    recv_counts: List[int]  # how many ids each requester asks of this rank
    requested_local: torch.Tensor  # local rows requested of this rank, by requester
    ledgers: List[CommLedger]
    # set by a table under the relaxed embedding dependency: its backward splits the rows
    relaxed: Optional[Any] = None
    table: Optional[Any] = None


def validate_ids(ids: torch.Tensor, num_embeddings: int) -> Optional[int]:
    """First offending id (the smallest invalid one), or None when all are valid."""
    if ids.numel() == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        return lo
    if hi >= num_embeddings:
        return hi
    return None


def invalid_id_message(bad_id: int, num_embeddings: int, rank: int) -> str:
    return (
        f"embedding id {bad_id} is out of range for a table of {num_embeddings} rows "
        f"(valid ids are 0..{num_embeddings - 1}); seen on rank {rank}"
    )


def plan_exchange(
    flat_ids: torch.Tensor,
    plan: ShardPlan,
    group: Optional["dist.ProcessGroup"],
    rank: int,
    ledger: Optional[CommLedger] = None,
) -> ExchangePlan:
    """Dedup and bucket the ids, then AlltoAll the header and the ids.

    Collective: every rank of ``group`` must call it, also with an empty batch.
    Raises :class:`InvalidIdError` on every rank if any rank holds an invalid id.
    """
    if flat_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"embedding ids must be an integer tensor, got {flat_ids.dtype}")
    world = plan.world_size
    ledgers = _ledgers(ledger)
    device = flat_ids.device
    # validate, dedup (sorted: shards are contiguous ranges, so the unique ids arrive
    # grouped by owner) and count per owner; native_ops says how
    bucketed = native_ops.dedup_bucket(flat_ids, plan.boundaries)
    bad = bucketed.bad_id

    if bad is None:
        unique_ids, inverse, send_counts = bucketed.unique_ids, bucketed.inverse, bucketed.send_counts
    else:
        unique_ids = flat_ids.new_zeros(0, dtype=torch.long)
        inverse = flat_ids.new_zeros(0, dtype=torch.long)
        send_counts = [0] * world

    header = torch.zeros(world, _HEADER_FIELDS, dtype=torch.long, device=device)
    header[:, 0] = torch.tensor(send_counts, dtype=torch.long)
    if bad is not None:
        header[:, 1] = 1
        header[:, 2] = bad
    recv_header = torch.empty_like(header)
    dist.all_to_all_single(recv_header, header, group=group)
    header_bytes = (world - 1) * _HEADER_FIELDS * header.element_size()
    _record(ledgers, K.COUNTS, header_bytes, header_bytes)

    flagged = recv_header[:, 1].nonzero().flatten().tolist()
    if flagged:
        src = flagged[0]
        raise InvalidIdError(
            invalid_id_message(int(recv_header[src, 2]), plan.num_embeddings, src)
            + (f" (raised on rank {rank} too, so no rank waits in a collective)" if src != rank else "")
        )
    recv_counts = recv_header[:, 0].tolist()

    wire = torch.int32 if plan.num_embeddings <= _INT32_LIMIT else torch.long
    send_ids = unique_ids.to(wire)
    recv_ids = torch.empty(sum(recv_counts), dtype=wire, device=device)
    dist.all_to_all_single(recv_ids, send_ids, recv_counts, send_counts, group=group)
    esize = send_ids.element_size()
    _record(ledgers, K.IDS, _off_rank(send_counts, rank) * esize, _off_rank(recv_counts, rank) * esize)

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
    )


def fetch_rows(shard: torch.Tensor, xp: ExchangePlan) -> torch.Tensor:
    """Owners gather the requested rows and AlltoAll them back: ``(U, D)`` rows."""
    dim = shard.shape[1]
    out_rows = native_ops.gather_rows(shard, xp.requested_local)
    rows = shard.new_empty(len(xp.unique_ids), dim)
    dist.all_to_all_single(rows, out_rows, xp.send_counts, xp.recv_counts, group=xp.group)
    row_bytes = dim * shard.element_size()
    _record(
        xp.ledgers,
        K.ROWS,
        _off_rank(xp.recv_counts, xp.rank) * row_bytes,
        _off_rank(xp.send_counts, xp.rank) * row_bytes,
    )
    return rows


def push_grad_rows(
    grad_unique: torch.Tensor,
    xp: ExchangePlan,
    shard_rows: int,
    scale: float,
    padding_local: Optional[int] = None,
) -> torch.Tensor:
    """Send each unique id's gradient row to its owner; return the shard gradient.

    ``scale`` turns the sum over ranks into the convention the caller wants
    (``1 / world_size`` gives the data-parallel average that DDP leaves in ``.grad``).
    """
    dim = grad_unique.shape[1]
    grad_unique = grad_unique.contiguous()
    recv = grad_unique.new_empty(len(xp.requested_local), dim)
    dist.all_to_all_single(recv, grad_unique, xp.recv_counts, xp.send_counts, group=xp.group)
    row_bytes = dim * grad_unique.element_size()
    _record(
        xp.ledgers,
        K.GRAD_ROWS,
        _off_rank(xp.send_counts, xp.rank) * row_bytes,
        _off_rank(xp.recv_counts, xp.rank) * row_bytes,
    )
    # zeros + index_add_ + mul_(scale) + padding row zeroed
    return native_ops.scatter_add_rows(recv, xp.requested_local, shard_rows, scale, padding_local)


class ShardedLookup(torch.autograd.Function):
    """Autograd node: shard -> rows of the unique ids (exchange in, grad rows out)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, xp: ExchangePlan, scale: float, padding_local: Optional[int]):  # type: ignore[override]
        ctx.xp, ctx.scale, ctx.padding_local = xp, scale, padding_local
        ctx.shard_rows = shard.shape[0]
        return fetch_rows(shard.detach(), xp)

    @staticmethod
    def backward(ctx, grad_unique: torch.Tensor):  # type: ignore[override]
        if ctx.xp.relaxed is not None:
            grad = ctx.xp.relaxed.push_grad_rows(ctx.xp.table, grad_unique, ctx.xp, ctx.shard_rows, ctx.scale,
                                                 ctx.padding_local)
        else:
            grad = push_grad_rows(grad_unique, ctx.xp, ctx.shard_rows, ctx.scale, ctx.padding_local)
        return grad, None, None, None


def _padded_all_gather(shard: torch.Tensor, plan: ShardPlan, group, rank: int, ledgers) -> torch.Tensor:
    # gloo's all_gather needs equal sizes on every rank: pad shards to the largest.
    world, rows = plan.world_size, plan.max_shard_size
    padded = shard.new_zeros(rows, *shard.shape[1:])
    padded[: shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    nbytes = padded.numel() * padded.element_size()
    _record(ledgers, K.TABLE_GATHER, (world - 1) * nbytes, (world - 1) * nbytes)
    return torch.cat([p[:n] for p, n in zip(parts, plan.sizes)], dim=0)


def gather_full(shard: torch.Tensor, plan: ShardPlan, group, rank: int, ledger: Optional[CommLedger] = None) -> torch.Tensor:
    """Full table on every rank (no autograd). Collective."""
    with torch.no_grad():
        return _padded_all_gather(shard.detach(), plan, group, rank, _ledgers(ledger))


def reduce_scatter_rows(full_grad: torch.Tensor, plan: ShardPlan, group, rank: int, scale: float, ledgers) -> torch.Tensor:
    """Sum a full-table gradient over ranks and keep this rank's rows (AlltoAll-based).

    gloo has no reduce_scatter; an AlltoAll of row blocks followed by a local sum moves
    the same (N-1)/N of the table a ring reduce-scatter would.
    """
    world = plan.world_size
    mine = plan.shard_size(rank)
    recv = full_grad.new_empty(world * mine, *full_grad.shape[1:])
    dist.all_to_all_single(recv, full_grad.contiguous(), [mine] * world, plan.sizes, group=group)
    row_bytes = full_grad[0].numel() * full_grad.element_size() if full_grad.shape[0] else 0
    _record(ledgers, K.TABLE_GRAD, (plan.num_embeddings - mine) * row_bytes, (world - 1) * mine * row_bytes)
    grad = recv.view(world, mine, *full_grad.shape[1:]).sum(0)
    if scale != 1.0:
        grad.mul_(scale)
    return grad


class GatherTable(torch.autograd.Function):
    """Autograd node: shard -> full table; backward reduce-scatters the table gradient.

    This is how a tied output projection reads a sharded table: the same volume as
    the dense all-reduce DDP would have spent on it, never more.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, plan: ShardPlan, group, rank: int, scale: float, ledger):  # type: ignore[override]
        ctx.plan, ctx.group, ctx.rank, ctx.scale = plan, group, rank, scale
        ctx.ledgers = _ledgers(ledger)
        return _padded_all_gather(shard.detach(), plan, group, rank, ctx.ledgers)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):  # type: ignore[override]
        grad = reduce_scatter_rows(grad_full, ctx.plan, ctx.group, ctx.rank, ctx.scale, ctx.ledgers)
        return grad, None, None, None, None, None


# ---------------------------------------------------------------------------------
# Overlapped table exchange: the model level of the 2D schedule applied to a tied
# table. The all-gather is issued early in the step and waited for only where the
# output projection needs the table; the reduce-scatter of its gradient is issued
# from backward and waited for only before anything reads the shard's ``.grad``.
# Each runs on its own process group, so neither interleaves with the lookups'
# AlltoAlls on the table's group (issued from the autograd thread).


#: trace lane of the overlapped table collectives (apart from the dense all-reduce's)
TABLE_TID = 3


def _record_async(ledgers: List[CommLedger], kind: str, sent: int, received: int, work: Any) -> None:
    """Count the bytes now; a tracing ledger also gets the collective as an event from
    its issue to its completion (taken from the work's future, not from the wait)."""
    for ledger in ledgers:
        if not isinstance(ledger, TracingLedger):
            ledger.record(kind, sent, received)
            continue
        CommLedger.record(ledger, kind, sent, received)
        if ledger.inner is not None:
            ledger.inner.record(kind, sent, received)
        tracer, start = ledger.tracer, ledger.tracer.now()
        if tracer.enabled:
            work.get_future().then(
                lambda _f, t=tracer, s=start: t.collective(kind, sent, s, t.now(), tid=TABLE_TID, received=int(received))
            )


class PendingGather:
    """An all-gather of a table's shards in flight (gloo: padded to equal sizes)."""

    def __init__(self, shard: torch.Tensor, plan: ShardPlan, group, ledgers: List[CommLedger]) -> None:
        self.plan = plan
        rows = plan.max_shard_size
        with torch.no_grad():
            padded = shard.new_zeros(rows, *shard.shape[1:])
            padded[: shard.shape[0]] = shard.detach()
        self._parts = [torch.empty_like(padded) for _ in range(plan.world_size)]
        self._work = dist.all_gather(self._parts, padded, group=group, async_op=True)
        self._padded = padded  # kept alive until the collective completes
        nbytes = (plan.world_size - 1) * padded.numel() * padded.element_size()
        _record_async(ledgers, K.TABLE_GATHER, nbytes, nbytes, self._work)
        self._full: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        """The full table (waits once; later calls return the same tensor)."""
        if self._full is None:
            self._work.wait()
            self._full = torch.cat([p[:n] for p, n in zip(self._parts, self.plan.sizes)], dim=0)
            self._parts, self._padded = [], None
        return self._full


class PendingTableGrads:
    """Reduce-scatters of full-table gradients in flight, accumulated into a shard's
    ``.grad`` by :meth:`finish` (one per backward through the projection)."""

    def __init__(self, plan: ShardPlan, group, rank: int, scale: float, ledgers: List[CommLedger]) -> None:
        self.plan, self.group, self.rank, self.scale, self.ledgers = plan, group, rank, scale, ledgers
        self._inflight: List[Any] = []  # (work, recv buffer)

    def __len__(self) -> int:
        return len(self._inflight)

    def start(self, full_grad: torch.Tensor) -> None:
        """Issue the AlltoAll of row blocks (the reduce-scatter without its local sum)."""
        plan, world = self.plan, self.plan.world_size
        mine = plan.shard_size(self.rank)
        full_grad = full_grad.contiguous()
        recv = full_grad.new_empty(world * mine, *full_grad.shape[1:])
        work = dist.all_to_all_single(recv, full_grad, [mine] * world, plan.sizes, group=self.group, async_op=True)
        row_bytes = full_grad[0].numel() * full_grad.element_size() if full_grad.shape[0] else 0
        _record_async(self.ledgers, K.TABLE_GRAD, (plan.num_embeddings - mine) * row_bytes,
                      (world - 1) * mine * row_bytes, work)
        self._inflight.append((work, recv, full_grad))

    def finish(self, shard: torch.Tensor) -> None:
        """Wait for every reduce-scatter in flight and add the results to ``shard.grad``."""
        mine = self.plan.shard_size(self.rank)
        while self._inflight:
            work, recv, _ = self._inflight.pop(0)
            work.wait()
            grad = recv.view(self.plan.world_size, mine, *recv.shape[1:]).sum(0)
            if self.scale != 1.0:
                grad.mul_(self.scale)
            with torch.no_grad():
                if shard.grad is None:
                    shard.grad = grad.to(shard.dtype)
                else:
                    shard.grad.add_(grad)


class PrefetchedTable(torch.autograd.Function):
    """Autograd node: shard -> full table from a gather already in flight; backward
    issues the gradient's reduce-scatter and returns at once (no gradient to the shard
    here: :meth:`PendingTableGrads.finish` adds it)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, pending: PendingGather, grads: PendingTableGrads):  # type: ignore[override]
        ctx.grads = grads
        return pending.wait()

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):  # type: ignore[override]
        ctx.grads.start(grad_full)
        return None, None, None
