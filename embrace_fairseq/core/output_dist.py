"""Output dist: rows travel back to the ranks that asked, gradient rows to their owners.

Forward: owners gather the rows an :class:`~embrace_fairseq.core.input_dist.ExchangePlan`
asked of them and AlltoAll them back. Backward mirrors it: each unique id's gradient
row goes to its owner, which adds it into the shard gradient, scaled to the
data-parallel average convention.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Union

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core import native_ops
from embrace_fairseq.core.input_dist import ExchangePlan
from embrace_fairseq.core.ledger import off_rank, record_all
from embrace_fairseq.core.node_exchange import NodeExchangePlan


def _exchange_rows(rows: torch.Tensor, out_counts: List[int], in_counts: List[int], xp: ExchangePlan,
                   kind: str) -> torch.Tensor:
    """AlltoAll ``rows`` (``out_counts[r]`` of them to rank r) and return the
    ``sum(in_counts)`` rows received; record the bytes that cross a link as ``kind``."""
    rows = rows.contiguous()
    received = rows.new_empty(sum(in_counts), rows.shape[1])
    collectives.all_to_all_single(received, rows, in_counts, out_counts, xp.group)
    row_bytes = rows.shape[1] * rows.element_size()
    off_node = xp.off_node(out_counts)
    record_all(xp.ledgers, kind, off_rank(out_counts, xp.rank) * row_bytes, off_rank(in_counts, xp.rank) * row_bytes,
               None if off_node is None else off_node * row_bytes)
    return received


def fetch_rows(shard: torch.Tensor, xp: ExchangePlan) -> torch.Tensor:
    """Owners gather the requested rows and AlltoAll them back: ``(U, D)`` rows."""
    out_rows = native_ops.gather_rows(shard, xp.requested_local)
    # owners send what each requester asked of them (recv_counts), requesters get send_counts
    return _exchange_rows(out_rows, xp.recv_counts, xp.send_counts, xp, K.ROWS)


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
    Half-precision rows are summed in fp32 and scaled before their one rounding, so a
    sum over ranks beyond the fp16 range whose average is within it stays finite
    (:func:`~embrace_fairseq.core.native_ops.scatter_add_rows`).
    """
    recv = _exchange_rows(grad_unique, xp.send_counts, xp.recv_counts, xp, K.GRAD_ROWS)
    # zeros + index_add_ + mul_(scale) + padding row zeroed
    return native_ops.scatter_add_rows(recv, xp.requested_local, shard_rows, scale, padding_local)


class ShardedLookup(torch.autograd.Function):
    """Autograd node: shard -> rows of the unique ids (exchange in, grad rows out), over
    the flat exchange or the node-aware one (:mod:`~embrace_fairseq.core.node_exchange`)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, xp: Union[ExchangePlan, NodeExchangePlan], scale: float,  # type: ignore[override]
                padding_local: Optional[int]):
        ctx.xp, ctx.scale, ctx.padding_local = xp, scale, padding_local
        ctx.shard_rows = shard.shape[0]
        if isinstance(xp, NodeExchangePlan):
            return xp.fetch_rows(shard.detach())
        return fetch_rows(shard.detach(), xp)

    @staticmethod
    def backward(ctx, grad_unique: torch.Tensor):  # type: ignore[override]
        # one backward, one exchange: whoever waits for it (a schedule's gate) sees it
        # begin and end here exactly once, however many outputs the lookup served
        with ctx.xp.grad_scope() if ctx.xp.grad_scope is not None else contextlib.nullcontext():
            if isinstance(ctx.xp, NodeExchangePlan):
                grad = ctx.xp.push_grad_rows(grad_unique, ctx.shard_rows, ctx.scale, ctx.padding_local)
            elif ctx.xp.relaxed is not None:
                grad = ctx.xp.relaxed.push_grad_rows(ctx.xp.table, grad_unique, ctx.xp, ctx.shard_rows, ctx.scale,
                                                     ctx.padding_local)
            else:
                grad = push_grad_rows(grad_unique, ctx.xp, ctx.shard_rows, ctx.scale, ctx.padding_local)
        return grad, None, None, None
