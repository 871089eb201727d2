"""Which ranks share a node: the cluster's shape as the exchange sees it.

Launchers number ranks node by node: ``torchrun`` and the ``deepspeed`` launcher give
rank ``node * ranks_per_node + local_rank`` and export the ranks on this node
(``LOCAL_WORLD_SIZE``; the ``deepspeed`` launcher: ``LOCAL_SIZE``) and ``LOCAL_RANK``. A :class:`NodeTopology` is that numbering: node ``n``
holds ranks ``[n*L, (n+1)*L)``, and the *rail* of local index ``j`` is the ranks with
that index on every node (``j, L+j, 2L+j, ...``): the ranks that talk across nodes in
the node-aware exchange (:mod:`~embrace_fairseq.core.node_exchange`).

:func:`node_groups` creates, once per topology, the process groups of every node and
every rail, after checking on every rank that the topology is the same everywhere and
matches the launcher's numbering (a mismatch would route rows through the wrong ranks:
it stops every rank with the reason instead).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from embrace_fairseq.core import collectives

#: Overrides the launcher's ``LOCAL_WORLD_SIZE`` (ranks per node), e.g. to emulate nodes
#: on one machine or to keep the flat exchange (set it to the world size).
RANKS_PER_NODE_ENV = "EMBRACE_RANKS_PER_NODE"

#: Where launchers say how many ranks run on this node: torchrun, then the deepspeed launcher.
_LAUNCHER_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")

#: Exchange modes a table accepts: ``auto`` is node-aware when there are several nodes of
#: several ranks each, flat otherwise.
EXCHANGES = ("auto", "flat", "node")


def check_exchange(exchange: str) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"unknown exchange {exchange!r}: choose one of {', '.join(EXCHANGES)}")
    return exchange


@dataclass(frozen=True)
class NodeTopology:
    """``world_size`` ranks on nodes of ``ranks_per_node`` ranks each, numbered node by node.

    >>> t = NodeTopology(6, 3)
    >>> t.num_nodes, t.node_of(4), t.local_of(4), t.node_ranks(1), t.rail_ranks(2)
    (2, 1, 1, [3, 4, 5], [2, 5])
    """

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size < 1:
            raise ValueError(f"world_size and ranks_per_node must be >= 1, got {self.world_size}, {self.ranks_per_node}")
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"{self.world_size} ranks do not fill nodes of {self.ranks_per_node} ranks each: every node must "
                f"run the same number of ranks (set {RANKS_PER_NODE_ENV} or --embrace-ranks-per-node to a divisor "
                "of the world size)")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def is_hierarchical(self) -> bool:
        """Several nodes of several ranks: the only case where routing through a node pays."""
        return self.num_nodes > 1 and self.ranks_per_node > 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> List[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def rail_ranks(self, local: int) -> List[int]:
        return list(range(local, self.world_size, self.ranks_per_node))

    def off_node(self, counts: Sequence[int], rank: int) -> int:
        """How many of ``counts`` (one per rank) go to ranks on other nodes than ``rank``'s."""
        node = self.node_of(rank)
        return sum(c for r, c in enumerate(counts) if self.node_of(r) != node)


def topology_for(world_size: int, ranks_per_node: Optional[int] = None) -> NodeTopology:
    """The topology of a job of ``world_size`` ranks: ``ranks_per_node`` when given, else
    ``EMBRACE_RANKS_PER_NODE``, else the launcher's ``LOCAL_WORLD_SIZE`` (torchrun) or
    ``LOCAL_SIZE`` (deepspeed), else one node (a job started without a launcher that
    says otherwise)."""
    if ranks_per_node is None:
        for var in (RANKS_PER_NODE_ENV, *_LAUNCHER_SIZE_VARS):
            value = os.environ.get(var, "")
            if value.strip():
                try:
                    ranks_per_node = int(value)
                except ValueError:
                    raise ValueError(f"{var}={value!r} is not a number of ranks") from None
                break
    return NodeTopology(world_size, world_size if ranks_per_node is None else min(int(ranks_per_node), world_size))


@dataclass
class NodeGroups:
    """The process groups of this rank's node and of its rail."""

    topology: NodeTopology
    rank: int
    node_group: collectives.Group
    rail_group: collectives.Group

    @property
    def node(self) -> int:
        return self.topology.node_of(self.rank)

    @property
    def local(self) -> int:
        return self.topology.local_of(self.rank)


_GROUPS: Dict[Tuple[int, NodeTopology, str], Tuple[Any, Optional[NodeGroups]]] = {}


def _launcher_disagrees(topology: NodeTopology, rank: int) -> bool:
    """The launcher's nodes are ``topology``'s (``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``
    ranks per node) but its ``LOCAL_RANK`` is not where ``topology`` puts ``rank``. Nodes given otherwise
    (``EMBRACE_RANKS_PER_NODE``, ``--embrace-ranks-per-node``: emulated or described by
    hand) are taken as given."""
    local = os.environ.get("LOCAL_RANK", "").strip()
    size = next((os.environ[v].strip() for v in _LAUNCHER_SIZE_VARS if os.environ.get(v, "").strip()), "")
    if not (local.isdigit() and size.isdigit()) or int(size) != topology.ranks_per_node:
        return False
    return int(local) != topology.local_of(rank)


def node_groups(topology: NodeTopology, purpose: str = "exchange") -> Optional[NodeGroups]:
    """The node and rail groups of ``topology`` over the default group, created once per
    topology, ``purpose`` (groups that two threads use at once must differ: the exchange
    runs on the autograd thread, the dense all-reduce on a communication thread) and
    default group; ``None`` when the topology is not hierarchical (one
    node, or one rank per node: the flat exchange is already node-aware there).
    Collective: every rank calls it, in the same order.

    Raises ``RuntimeError`` on every rank when ranks disagree on the topology or the
    launcher numbered ranks otherwise than node by node."""
    world = collectives.world_size()
    rank = collectives.rank()
    if topology.world_size != world:
        raise ValueError(f"a topology of {topology.world_size} ranks in a job of {world}")
    default = torch.distributed.group.WORLD
    key = (id(default), topology, purpose)
    cached = _GROUPS.get(key)
    if cached is not None and cached[0] is default:
        return cached[1]
    # one round: min and max of ranks-per-node, and whether any rank's LOCAL_RANK disagrees
    probe = torch.tensor([topology.ranks_per_node, -topology.ranks_per_node, int(_launcher_disagrees(topology, rank))],
                         dtype=torch.long)
    collectives.all_reduce(probe, op="max")
    if int(probe[0]) != -int(probe[1]):
        raise RuntimeError(
            f"ranks disagree on the ranks per node ({-int(probe[1])} to {int(probe[0])}): give every node the same "
            f"{RANKS_PER_NODE_ENV} / --embrace-ranks-per-node, or none")
    if int(probe[2]):
        raise RuntimeError(
            f"the launcher's LOCAL_RANK does not number ranks node by node in nodes of {topology.ranks_per_node} "
            f"(rank = node * {topology.ranks_per_node} + LOCAL_RANK): the node-aware exchange would route through "
            "the wrong ranks; use --embrace-exchange flat, or set "
            f"{RANKS_PER_NODE_ENV} to describe the nodes")
    if not topology.is_hierarchical:
        _GROUPS[key] = (default, None)
        return None
    node_group = rail_group = None
    # every rank creates every group, in the same order (torch.distributed.new_group's rule)
    for node in range(topology.num_nodes):
        g = collectives.new_group(topology.node_ranks(node))
        if node == topology.node_of(rank):
            node_group = g
    for local in range(topology.ranks_per_node):
        g = collectives.new_group(topology.rail_ranks(local))
        if local == topology.local_of(rank):
            rail_group = g
    groups = NodeGroups(topology, rank, node_group, rail_group)
    _GROUPS[key] = (default, groups)
    return groups
