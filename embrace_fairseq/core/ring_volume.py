"""Bytes one rank sends in a ring collective: the one place these formulas are written.

Ring algorithms are bandwidth-optimal, and the analytic bounds, the cost model and
the benchmark's byte counter all assume them (docs/DESIGN.md, "Volume per rank per step"):

* all-reduce of ``M`` bytes: a reduce-scatter then an all-gather, ``2 (N-1)/N M``;
* all-gather of blocks adding up to ``M``: every rank forwards all blocks but one,
  ``(N-1)/N M`` on average, or ``(N-1) b`` for one rank's own block of ``b`` bytes;
* reduce-scatter of ``M`` bytes: as much as the all-gather, ``(N-1)/N M``.

A world of one sends nothing. Pure arithmetic (no torch), so the lowest layer and
the performance tools can share it.
"""
from __future__ import annotations


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def ring_allgather_bytes(total_nbytes: float, world_size: int) -> float:
    """Average bytes one rank sends in a ring all-gather whose blocks add up to
    ``total_nbytes``: ``(N-1)/N total``. Also the volume of a ring reduce-scatter."""
    return (world_size - 1) / world_size * total_nbytes if world_size > 1 else 0.0


ring_reduce_scatter_bytes = ring_allgather_bytes


def ring_allreduce_bytes_int(nbytes: int, world_size: int) -> int:
    """:func:`ring_allreduce_bytes` in whole bytes (floor), for byte ledgers."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


def ring_allgather_block_bytes(block_nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of its own ``block_nbytes``: it forwards
    the ``N-1`` blocks of the others (``(N-1) block``; equal blocks, so exact per rank)."""
    return (world_size - 1) * block_nbytes if world_size > 1 else 0
