"""Per-step embedding traffic from unique-id counts: a Zipf model of the vocabulary.

Measured unique ids per rank are matched by a Zipf law over the (frequency-sorted)
vocabulary, which also gives what a contiguous shard plan implies: the rank owning
the head of the vocabulary serves far more rows than the others, and the share of
gradient rows the next batch reads.

On nodes, the same law gives what the node-aware exchange merges (:func:`node_loads`):
the ``K`` ranks of a node draw ``K`` times the tokens of one, so their union of unique
ids is the per-rank count at ``K`` times the draws, less than ``K`` per-rank counts
because hot ids are drawn by several ranks.
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


@dataclass(frozen=True)
class NodeLoads:
    """Per-step rows of the exchange on nodes, for one world size and node size: the two
    hops of the node-aware exchange, and what each route puts through the busiest node's NIC.

    Every figure is a count of rows (or ids) each way; the bytes follow from the row and
    id sizes. A NIC figure is the max over nodes of the larger direction: the rows its
    ranks send off the node or the rows they receive from other nodes (full duplex).
    """

    ranks_per_node: int
    node_unique_mean: float  # unique ids of a node's ranks together (the proxies' union)
    dedup_ratio: float  # ids crossing between nodes per step, node-aware over flat
    node_hop_rows: float  # inside the node: max over ranks of max(rows sent to, received from its proxies)
    rail_rows: float  # across nodes: max over ranks of max(rows it sends, rows it receives) on its rail
    rail_nic_rows: float  # the node's K rails through its NIC
    flat_nic_rows: float  # the flat exchange's rows leaving (entering) the node through its NIC


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
    own = _owned(q, n, layout)
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


def _owned(q: np.ndarray, n: int, layout: str) -> np.ndarray:
    """Expected ids of each owner among those with presence ``q`` (id order = frequency rank)."""
    if layout == "strided":
        return np.array([q[r::n].sum() for r in range(n)])
    base, extra = divmod(len(q), n)
    bounds = np.cumsum([0] + [base + (1 if r < extra else 0) for r in range(n)])
    return np.array([q[bounds[r] : bounds[r + 1]].sum() for r in range(n)])


def node_loads(vocab: int, world_size: int, ranks_per_node: int, loads: SparseLoads, *, zipf_s: float = 1.0,
               layout: str = "contiguous") -> NodeLoads:
    """What the exchange moves on ``world_size`` ranks in nodes of ``ranks_per_node`` (ranks
    numbered node by node), for the per-rank draws of ``loads`` (:func:`sparse_loads`, whose
    measured-to-model scale it keeps).

    Node-aware route (:mod:`embrace_fairseq.core.node_exchange`). Node hop: a rank sends
    each unique id to its proxy, the rank of its node with the owner's local index (ids of
    its own local index stay on it); a proxy receives its index's ids from the ``K - 1``
    others. Rail hop: a proxy asks each owner on its rail for the node's union of that
    owner's ids (``K`` ranks' draws together); an owner receives one such request per other
    node. Flat route: a node's owners answer every rank off the node, its ranks ask every
    owner off it. Rows and gradient rows take the same hops as the ids, as many each way.

    The NICs are summed over the node's ranks rather than taken as ``K`` times the busiest
    rank: the same when every rank is as busy (strided shards), far less when one rank
    serves the head of the vocabulary (contiguous shards). With one rank per node the rail
    hop is the flat exchange.
    """
    n, k = world_size, ranks_per_node
    if k < 1 or n % k:
        raise ValueError(f"{n} ranks do not fill nodes of {k}")
    p = _zipf_probs(vocab, zipf_s)
    q_rank = _expected_present(p, loads.tokens_eff)
    q_node = _expected_present(p, k * loads.tokens_eff)
    u, u_node = float(q_rank.sum()), float(q_node.sum())
    scale = loads.unique_mean / u if u > 0 else 1.0
    m = n // k
    own_rank = _owned(q_rank, n, layout).reshape(m, k)  # [node, local index]: a rank's ids by owner
    own_node = _owned(q_node, n, layout).reshape(m, k)  # a node's union by owner
    by_proxy = own_rank.sum(axis=0)  # a rank's ids per proxy (local index of their owner)
    node_hop = np.maximum(u - by_proxy, (k - 1) * by_proxy).max() if k > 1 else 0.0
    rail = own_node.sum(axis=0)  # a node's union per rail
    rail_rows = np.maximum(rail[None, :] - own_node, (m - 1) * own_node).max() if m > 1 else 0.0
    # through each NIC: owners answer the ranks (proxies) off the node, the ranks (proxies)
    # receive what is owned off it
    on_node, on_node_union = own_rank.sum(axis=1), own_node.sum(axis=1)
    flat_nic = np.maximum((n - k) * on_node, k * (u - on_node)).max()
    rail_nic = np.maximum((m - 1) * on_node_union, u_node - on_node_union).max()
    # ids whose owner is on another node, summed over the nodes: each rank's own (flat)
    # against each node's union (what the node-aware route sends)
    flat_across = float((k * (u - on_node)).sum())
    return NodeLoads(
        ranks_per_node=k,
        node_unique_mean=u_node * scale,
        dedup_ratio=float((u_node - on_node_union).sum()) / flat_across if flat_across > 0 else 1.0,
        node_hop_rows=float(node_hop) * scale,
        rail_rows=float(rail_rows) * scale,
        rail_nic_rows=float(rail_nic) * scale,
        flat_nic_rows=float(flat_nic) * scale,
    )
