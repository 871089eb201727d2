"""Output dist: rows travel back to the ranks that asked, gradient rows to their owners.

Forward: owners gather the rows an :class:`~embrace_fairseq.core.input_dist.ExchangePlan`
asked of them and AlltoAll them back. Backward mirrors it: each unique id's gradient
row goes to its owner, which adds it into the shard gradient, scaled to the
data-parallel average convention.
"""
from __future__ import annotations

from typing import Optional

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core import native_ops
from embrace_fairseq.core.input_dist import ExchangePlan
from embrace_fairseq.core.ledger import off_rank, record_all


def fetch_rows(shard: torch.Tensor, xp: ExchangePlan) -> torch.Tensor:
    """Owners gather the requested rows and AlltoAll them back: ``(U, D)`` rows."""
    dim = shard.shape[1]
    out_rows = native_ops.gather_rows(shard, xp.requested_local)
    rows = shard.new_empty(len(xp.unique_ids), dim)
    collectives.all_to_all_single(rows, out_rows, xp.send_counts, xp.recv_counts, xp.group)
    row_bytes = dim * shard.element_size()
    record_all(
        xp.ledgers,
        K.ROWS,
        off_rank(xp.recv_counts, xp.rank) * row_bytes,
        off_rank(xp.send_counts, xp.rank) * row_bytes,
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
    collectives.all_to_all_single(recv, grad_unique, xp.recv_counts, xp.send_counts, xp.group)
    row_bytes = dim * grad_unique.element_size()
    record_all(
        xp.ledgers,
        K.GRAD_ROWS,
        off_rank(xp.send_counts, xp.rank) * row_bytes,
        off_rank(xp.recv_counts, xp.rank) * row_bytes,
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
