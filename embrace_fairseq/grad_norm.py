"""Global gradient norm when some gradients are sharded.

A replicated gradient is identical on every rank, so its norm is local. A sharded
gradient is split over ranks, so its squared norm must be summed over the group.
Every rank then sees the same total and takes the same clipping (and fp16 overflow)
decision.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


def sharded_sq_norm(grads: Iterable[torch.Tensor], group: Optional["dist.ProcessGroup"] = None) -> torch.Tensor:
    """Sum over the group of the squared L2 norms of this rank's shard gradients.

    Collective when torch.distributed is initialised: every rank must call it, also
    with an empty list (its contribution is then zero).
    """
    grads = list(grads)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32) ** 2
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq, group=group)
    return sq


def combine_norms(dense_norm: torch.Tensor, sharded_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(dense^2 + sharded^2) in float32 (inf/nan propagate, as overflow checks need)."""
    dense = dense_norm.float().to(sharded_sq.device)
    return torch.sqrt(dense * dense + sharded_sq)
