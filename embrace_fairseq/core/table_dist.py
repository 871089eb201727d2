"""Full-table dist: a sharded table read whole, by a tied output projection or a checkpoint.

All-gather the shards (padded to equal sizes: gloo needs them), and the mirror for the
gradient: a reduce-scatter of the full-table gradient to the rows' owners. Full tables
are in vocabulary order on both sides, whatever the plan's layout (the row blocks on
the wire are in plan order). Together
they move what DDP's all-reduce of the table would, never more. The overlapped variant
issues the gather early in the step and the reduce-scatter from backward, each on its
own process group, and waits only where the table or the shard gradient is read.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ledger import CommLedger, ledgers_for, record_all
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.trace import mark_start, record_async


def _record_gather(plan: ShardPlan, shard: torch.Tensor, ledgers, kind: str = K.TABLE_GATHER) -> None:
    world = plan.world_size
    nbytes = plan.max_shard_size * math.prod(shard.shape[1:]) * shard.element_size()
    record_all(ledgers, kind, (world - 1) * nbytes, (world - 1) * nbytes)


def _record_grad(plan: ShardPlan, full_grad: torch.Tensor, rank: int, ledgers) -> None:
    mine = plan.shard_size(rank)
    row_bytes = full_grad[0].numel() * full_grad.element_size() if full_grad.shape[0] else 0
    record_all(ledgers, K.TABLE_GRAD, (plan.num_embeddings - mine) * row_bytes,
               (plan.world_size - 1) * mine * row_bytes)


def _padded_all_gather(shard: torch.Tensor, plan: ShardPlan, group, rank: int, ledgers,
                       kind: str = K.TABLE_GATHER) -> torch.Tensor:
    # gloo's all_gather needs equal sizes on every rank: padded to the largest shard
    mark_start(ledgers)
    full = collectives.all_gather_rows(shard, plan.sizes, group)  # row blocks in plan order
    _record_gather(plan, shard, ledgers, kind)
    return plan.to_vocab_order(full)  # in vocabulary order, whatever the layout


def gather_full(shard: torch.Tensor, plan: ShardPlan, group, rank: int, ledger: Optional[CommLedger] = None,
                kind: str = K.TABLE_GATHER) -> torch.Tensor:
    """Full table on every rank (no autograd), its bytes recorded as ``kind``. Collective."""
    with torch.no_grad():
        return _padded_all_gather(shard.detach(), plan, group, rank, ledgers_for(ledger), kind)


def reduce_scatter_rows(full_grad: torch.Tensor, plan: ShardPlan, group, rank: int, scale: float, ledgers) -> torch.Tensor:
    """Sum a full-table gradient (vocabulary order) over ranks and keep this rank's rows,
    times ``scale`` (AlltoAll-based: the row blocks per owner are in plan order; fp16/bf16
    summed in fp32 and scaled before their one rounding)."""
    mark_start(ledgers)
    grad = collectives.reduce_scatter_rows(plan.to_plan_order(full_grad), plan.sizes, group, scale)
    _record_grad(plan, full_grad, rank, ledgers)
    return grad


def gather_table(shard: torch.Tensor, plan: ShardPlan, group, rank: int, scale: float, ledger) -> torch.Tensor:
    """Shard -> full table as a differentiable tensor; the backward reduce-scatters the
    table gradient (times ``scale``, applied before a half gradient's one rounding). This
    is how a tied output projection reads a sharded table: the same volume as the dense
    all-reduce DDP would spend on it."""
    ledgers = ledgers_for(ledger)
    _record_gather(plan, shard, ledgers)
    full = collectives.gather_rows_from_group(
        shard, plan.sizes, group, scale, on_backward=lambda g: _record_grad(plan, g, rank, ledgers))
    # plan order -> vocabulary order; the index_select's backward puts the gradient
    # back in plan order before the reduce-scatter
    return plan.to_vocab_order(full)


class PendingGather:
    """An all-gather of a table's shards in flight (gloo: padded to equal sizes)."""

    def __init__(self, shard: torch.Tensor, plan: ShardPlan, group, ledgers: List[CommLedger]) -> None:
        self.plan = plan
        rows = plan.max_shard_size
        with torch.no_grad():
            padded = shard.new_zeros(rows, *shard.shape[1:])
            padded[: shard.shape[0]] = shard.detach()
        self._pending: Optional[collectives.Pending] = collectives.all_gather_async(padded, group)
        nbytes = (plan.world_size - 1) * padded.numel() * padded.element_size()
        record_async(ledgers, K.TABLE_GATHER, nbytes, nbytes, self._pending)
        self._full: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        """The full table (waits once; later calls return the same tensor)."""
        if self._full is None:
            parts = self._pending.wait()
            self._full = self.plan.assemble(parts)  # in vocabulary order, whatever the layout
            self._pending = None
        return self._full


class PendingTableGrads:
    """Reduce-scatters of full-table gradients in flight, accumulated into a shard's
    ``.grad`` by :meth:`finish` (one per backward through the projection)."""

    def __init__(self, plan: ShardPlan, group, rank: int, scale: float, ledgers: List[CommLedger]) -> None:
        self.plan, self.group, self.rank, self.scale, self.ledgers = plan, group, rank, scale, ledgers
        self._inflight: List[Any] = []  # (pending collective, recv buffer, send buffer)

    def __len__(self) -> int:
        return len(self._inflight)

    def start(self, full_grad: torch.Tensor) -> None:
        """Issue the AlltoAll of row blocks (the reduce-scatter without its local sum)."""
        plan, world = self.plan, self.plan.world_size
        mine = plan.shard_size(self.rank)
        full_grad = plan.to_plan_order(full_grad).contiguous()
        recv = full_grad.new_empty(world * mine, *full_grad.shape[1:])
        work = collectives.all_to_all_single_async(recv, full_grad, [mine] * world, list(plan.sizes), self.group)
        row_bytes = full_grad[0].numel() * full_grad.element_size() if full_grad.shape[0] else 0
        record_async(self.ledgers, K.TABLE_GRAD, (plan.num_embeddings - mine) * row_bytes,
                      (world - 1) * mine * row_bytes, work)
        self._inflight.append((work, recv, full_grad))

    def finish(self, shard: torch.Tensor) -> None:
        """Wait for every reduce-scatter in flight and add the results to ``shard.grad``."""
        mine = self.plan.shard_size(self.rank)
        while self._inflight:
            work, recv, _ = self._inflight.pop(0)
            work.wait()
            # fp16/bf16: summed in fp32 and scaled before the one rounding (the N ranks'
            # sum may overflow the half range where the average does not)
            grad = collectives.sum_row_blocks(recv.view(self.plan.world_size, mine, *recv.shape[1:]), self.scale)
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
