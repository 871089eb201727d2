"""Per-step embedding traffic from unique-id counts: a Zipf model of the vocabulary.

Measured unique ids per rank are matched by a Zipf law over the (frequency-sorted)
vocabulary, which also gives what a contiguous shard plan implies: the rank owning
the head of the vocabulary serves far more rows than the others, and the share of
gradient rows the next batch reads.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class SparseLoads:
    """Per-step embedding traffic in rows (and ids), for one world size."""

    unique_mean: float  # unique ids per rank
    unique_max: float
    off_owner_mean: float  # unique ids a rank asks of other owners
    busiest_rows: float  # max over ranks of max(rows it sends, rows it receives)
    next_step_share: float  # share of gradient rows the next step reads (urgent ones)
    tokens_eff: float  # Zipf draws per rank that give unique_mean


@functools.lru_cache(maxsize=32)
def _zipf_probs(vocab: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    return p / p.sum()


def _expected_present(p: np.ndarray, draws: float) -> np.ndarray:
    # P(id drawn at least once in `draws` tokens) = 1 - (1 - p)^draws, stably
    return -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-15)))


@functools.lru_cache(maxsize=256)
def zipf_tokens_for_unique(vocab: int, unique: float, s: float = 1.0) -> float:
    """Tokens per rank for which a Zipf(s) vocabulary yields ``unique`` distinct ids."""
    p = _zipf_probs(vocab, s)
    unique = min(max(unique, 1.0), vocab * 0.999)
    lo, hi = 1.0, 1.0
    while _expected_present(p, hi).sum() < unique:
        hi *= 2
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if _expected_present(p, mid).sum() < unique:
            lo = mid
        else:
            hi = mid
    return hi


def sparse_loads(
    vocab: int,
    world_size: int,
    *,
    tokens_per_rank: Optional[float] = None,
    unique_per_rank: Optional[Sequence[float]] = None,
    zipf_s: float = 1.0,
    layout: str = "contiguous",
) -> SparseLoads:
    """Embedding traffic under a contiguous shard plan, ids Zipf-distributed by id.

    fairseq dictionaries are sorted by frequency, so id order is frequency rank and
    rank 0 owns the head of the vocabulary. Measured unique counts, when given, fix
    the effective number of draws; otherwise ``tokens_per_rank`` does. ``layout``
    ``"strided"`` (id ``v`` on rank ``v % N``) shows what spreading the head would give.
    """
    if layout not in ("contiguous", "strided"):
        raise ValueError(f"layout must be 'contiguous' or 'strided', got {layout!r}")
    p = _zipf_probs(vocab, zipf_s)
    if unique_per_rank:
        mean_u = float(np.mean(unique_per_rank))
        draws = zipf_tokens_for_unique(vocab, mean_u, zipf_s)
    elif tokens_per_rank:
        draws = float(tokens_per_rank)
    else:
        raise ValueError("need tokens_per_rank or unique_per_rank")
    q = _expected_present(p, draws)
    u = float(q.sum())
    n = world_size
    base, extra = divmod(vocab, n)
    bounds = np.cumsum([0] + [base + (1 if r < extra else 0) for r in range(n)])
    if layout == "strided":
        own = np.array([q[r::n].sum() for r in range(n)])
    else:
        own = np.array([q[bounds[r] : bounds[r + 1]].sum() for r in range(n)])
    sends = (n - 1) * own  # an owner serves every other rank's requests of its rows
    recvs = u - own  # a rank receives the rows it does not own
    busiest = float(np.max(np.maximum(sends, recvs))) if n > 1 else 0.0
    q_next = _expected_present(p, draws * n)  # read by some rank in the next step
    share = float((q * q_next).sum() / u) if u > 0 else 1.0
    umax = float(max(unique_per_rank)) if unique_per_rank else u
    scale = (float(np.mean(unique_per_rank)) / u) if unique_per_rank and u > 0 else 1.0
    return SparseLoads(
        unique_mean=u * scale,
        unique_max=umax,
        off_owner_mean=u * scale * (n - 1) / n if n > 1 else 0.0,
        busiest_rows=busiest * scale,
        next_step_share=share,
        tokens_eff=draws,
    )
