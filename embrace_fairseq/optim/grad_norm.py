"""Global gradient norm when some gradients are sharded.

A replicated gradient is identical on every rank, so its norm is local. A sharded
gradient is split over ranks, so its squared norm must be summed over the group.
Every rank then sees the same total and takes the same clipping (and fp16 overflow)
decision.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.core.native_ops import host_ints


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
    if collectives.is_distributed():
        collectives.all_reduce(sq, group=group)
    return sq


def combine_norms(dense_norm: torch.Tensor, sharded_sq: torch.Tensor) -> torch.Tensor:
    """sqrt(dense^2 + sharded^2) in float32 (inf/nan propagate, as overflow checks need)."""
    dense = dense_norm.float().to(sharded_sq.device)
    return torch.sqrt(dense * dense + sharded_sq)


def local_nonfinite(grads: Iterable[Optional[torch.Tensor]]) -> torch.Tensor:
    """Whether any of this rank's gradients holds an inf/NaN: a 1-element bool tensor on
    their device, computed there (no host sync). Local: a caller that needs one decision
    on every rank reduces it (DeepSpeed's overflow check all-reduces its flag with MAX).

    >>> local_nonfinite([torch.ones(2), torch.tensor([1.0, float("inf")])]).tolist()
    [True]
    """
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros(1, dtype=torch.bool)
    return torch.stack([~torch.isfinite(g.detach()).all() for g in present]).any().reshape(1)


class NonFiniteGradientError(FloatingPointError):
    """Some rank holds an inf/NaN gradient; raised on every rank, naming where."""


def _exact_flags(named: List[Tuple[str, Optional[torch.Tensor]]], world: int, rank: int,
                 device: torch.device) -> torch.Tensor:
    """This rank's row of the ``world x len(named)`` non-finite flags (the other rows 0),
    from ``isfinite`` over every element: the round that decides when a norm flagged."""
    flags = torch.zeros(world, max(1, len(named)), dtype=torch.float32, device=device)
    idx = [i for i, (_, g) in enumerate(named) if g is not None]
    if not idx:
        return flags
    bad = [~torch.isfinite(named[i][1]).all() for i in idx]
    flags[rank, torch.tensor(idx, device=device)] = torch.stack(bad).to(device=device, dtype=torch.float32)
    return flags


def nonfinite_gradients(
    named_grads: Iterable[Tuple[str, Optional[torch.Tensor]]], group: Optional["dist.ProcessGroup"] = None
) -> List[Tuple[str, int]]:
    """(name, rank) of every gradient that is non-finite on some rank, the same list on
    every rank. Collective when torch.distributed is initialised: every rank passes the
    same names in the same order (a missing gradient counts as finite).

    One all-reduce of flags from each gradient's norm (no per-tensor host sync); only
    when some rank flags one, a second, exact round over every element decides
    (:func:`nonfinite_and_norm` without shards)."""
    named = list(named_grads)
    return nonfinite_and_norm(named, [False] * len(named), group)[0]


def nonfinite_and_norm(
    named_grads: Iterable[Tuple[str, Optional[torch.Tensor]]], sharded: Sequence[bool],
    group: Optional["dist.ProcessGroup"] = None,
) -> Tuple[List[Tuple[str, int]], torch.Tensor]:
    """:func:`nonfinite_gradients` and the global L2 norm (replicated gradients local, the
    shards' squares summed over the group, as :func:`combine_norms` of
    :func:`sharded_sq_norm`) from one norm per gradient and one all-reduce: the flags and
    the shards' squared norm travel together. ``sharded[i]``: whether gradient ``i`` is
    a shard. Collective, like :func:`nonfinite_gradients`; the exact round runs only when
    some rank flags a gradient.

    >>> bad, norm = nonfinite_and_norm([("w", torch.tensor([3.0])), ("rows", torch.tensor([4.0]))], [False, True])
    >>> bad, float(norm)
    ([], 5.0)
    """
    named = list(named_grads)
    dist_on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if dist_on else 1
    rank = dist.get_rank(group) if dist_on else 0
    device = next((g.device for _, g in named if g is not None), torch.device("cpu"))
    width = max(1, len(named))
    buf = torch.zeros(world * width + 1, dtype=torch.float32, device=device)  # flags, then the shards' square
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    idx = [i for i, (_, g) in enumerate(named) if g is not None]
    if idx:
        norms = torch.stack([torch.linalg.vector_norm(named[i][1].detach(), 2, dtype=torch.float32) for i in idx])
        # host integers staged without a blocking copy (no host sync on a GPU)
        buf[:-1].view(world, width)[rank, host_ints(idx, device)] = (~torch.isfinite(norms)).float()
        is_shard = host_ints([int(bool(sharded[i])) for i in idx], device).bool()
        squares = norms * norms
        zero = squares.new_zeros(())
        # where, not a boolean index: no host synchronisation on a GPU
        dense_sq = torch.where(is_shard, zero, squares).sum()
        buf[-1] = torch.where(is_shard, squares, zero).sum()
    if dist_on and world > 1:
        collectives.all_reduce(buf, group=group)
    flags = buf[:-1].view(world, width)
    # kept host sync (one per step): stopping the ranks is a host decision
    found = [(named[i][0], r) for r, i in flags.nonzero().tolist()] if named else []
    if found:  # a norm overflowed or a gradient is not finite: the exact round decides
        exact = _exact_flags(named, world, rank, device)
        if dist_on and world > 1:
            collectives.all_reduce(exact, group=group)
        found = [(named[i][0], r) for r, i in exact.nonzero().tolist()]
    return found, combine_norms(dense_sq.sqrt(), buf[-1])


def raise_if_nonfinite(bad: List[Tuple[str, int]], what: str = "gradient") -> None:
    """Raise :class:`NonFiniteGradientError` naming every (name, rank) in ``bad``."""
    if bad:
        where = ", ".join(f"{name} on rank {r}" for name, r in bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise NonFiniteGradientError(f"non-finite (inf/NaN) {what}: {where}; every rank stops at this step")
