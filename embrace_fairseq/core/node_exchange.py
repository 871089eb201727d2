"""Node-aware exchange: a row crosses the slow link between two nodes once per node.

The flat exchange (:mod:`~embrace_fairseq.core.input_dist`,
:mod:`~embrace_fairseq.core.output_dist`) sends each rank's unique ids straight to their
owners. When two ranks of one node ask for the same hot row of an owner on another node,
the row crosses the inter-node link twice, and so do the two gradient rows. Here every
request takes two hops, the second along a *rail* (the ranks with the same local index
on every node, see :mod:`~embrace_fairseq.core.node_topology`):

1. **node hop** (fast link): rank ``(n, i)`` sends each unique id to ``(n, j)``, the rank
   of its own node with the owner's local index ``j``: its *proxy* for that owner;
2. **rail hop** (slow link): the proxy merges the ids of its whole node, dedups them, and
   asks each owner ``(m, j)`` once.

Rows come back the same way: owners answer proxies over the rail, proxies fan the rows
out inside the node. Backward is the mirror: gradient rows go to the proxy, which sums
them per unique id and scales the sum, so one summed row per node crosses to the owner.
An owner on the requester's own node is its own proxy's rail peer on that node (a
self-send: no link).

Same rows, same shard gradient as the flat exchange: only the summation order of a
row's gradient differs (per node first, scaled, then over nodes), as between any two
all-reduce algorithms. The byte ledger records the node hop's bytes as staying on the
node and the rail hop's as leaving it.

Errors travel in the headers of both hops (count, flag, first bad id, its rank), so an
invalid id on any rank stops every rank of every node right after the rail header,
naming the id and the rank: no rank waits in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core import native_ops
from embrace_fairseq.core.ids import InvalidIdError, invalid_id_message
from embrace_fairseq.core.input_dist import wire_dtype
from embrace_fairseq.core.ledger import CommLedger, ledgers_for, off_rank, record_all
from embrace_fairseq.core.node_topology import NodeGroups
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.trace import mark_start

_HEADER_FIELDS = 4  # (count, has_bad_id, first_bad_id, rank that saw it)


@dataclass
class NodeExchangePlan:
    """What one node-aware forward exchange agreed on; the backward reuses it.

    ``unique_ids`` and ``inverse`` mean what they mean in
    :class:`~embrace_fairseq.core.input_dist.ExchangePlan` (the table expands rows with them).
    """

    plan: ShardPlan
    groups: NodeGroups
    rank: int
    unique_ids: torch.Tensor  # sorted unique plan-order ids this rank asked for (U,)
    inverse: torch.Tensor  # position in the flat batch -> index into unique_ids
    order: torch.Tensor  # unique_ids[order]: the ids grouped by proxy (owner's local index)
    node_send: List[int]  # ids this rank sends to each proxy of its node
    node_recv: List[int]  # ids each rank of the node sent this rank, as a proxy
    proxy_inverse: torch.Tensor  # id received as a proxy -> index into the proxy's unique ids
    proxy_ids: int  # how many unique ids this rank asks over the rail, as a proxy
    rail_send: List[int]  # proxy: unique ids asked of the owner on each node
    rail_recv: List[int]  # owner: ids each node's proxy asked of this rank
    requested_local: torch.Tensor  # owner: local rows asked of this rank, by node
    ledgers: List[CommLedger]
    grad_scope: Optional[Callable[[], ContextManager[None]]] = None
    relaxed: Optional[Any] = None  # the relaxed dependency keeps the flat exchange
    table: Optional[Any] = None

    # ------------------------------------------------------------------ rows
    def fetch_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """Owners answer the proxies, proxies answer their node: ``(U, D)`` rows."""
        g = self.groups
        served = native_ops.gather_rows(shard, self.requested_local)
        at_proxy = _exchange(served, self.rail_recv, self.rail_send, g.rail_group, g.node, self.ledgers, K.ROWS, True)
        fanned = native_ops.gather_rows(at_proxy, self.proxy_inverse, use="expand")
        got = _exchange(fanned, self.node_recv, self.node_send, g.node_group, g.local, self.ledgers, K.ROWS, False)
        rows = got.new_empty(got.shape)
        rows[self.order] = got  # back from proxy order to unique-id order
        return rows

    def push_grad_rows(self, grad_unique: torch.Tensor, shard_rows: int, scale: float,
                       padding_local: Optional[int] = None) -> torch.Tensor:
        """Gradient rows to the proxies, summed per node, then to the owners: the shard
        gradient (``scale`` as in :func:`~embrace_fairseq.core.output_dist.push_grad_rows`).

        The proxy applies ``scale``: it sums its node's rows in fp32 and scales the sum
        before its one rounding to the row dtype. A node's sum of fp16 rows may exceed the
        half range where its share of the average (what DDP, which divides before it
        sums, leaves) does not; the owner then adds the nodes' scaled sums."""
        g = self.groups
        by_proxy = grad_unique.index_select(0, self.order)
        at_proxy = _exchange(by_proxy, self.node_send, self.node_recv, g.node_group, g.local, self.ledgers,
                             K.GRAD_ROWS, False)
        node_sums = native_ops.scatter_add_rows(at_proxy, self.proxy_inverse, self.proxy_ids, scale,
                                                use="per_unique")
        at_owner = _exchange(node_sums, self.rail_send, self.rail_recv, g.rail_group, g.node, self.ledgers,
                             K.GRAD_ROWS, True)
        return native_ops.scatter_add_rows(at_owner, self.requested_local, shard_rows, 1.0, padding_local)


def _exchange(rows: torch.Tensor, out_counts: List[int], in_counts: List[int], group: collectives.Group,
              self_index: int, ledgers: List[CommLedger], kind: str, crosses_nodes: bool) -> torch.Tensor:
    """AlltoAll ``rows`` over ``group`` (``out_counts[k]`` to its k-th rank) and record the
    bytes that leave this rank, as leaving the node or not."""
    rows = rows.contiguous()
    received = rows.new_empty(sum(in_counts), *rows.shape[1:])
    collectives.all_to_all_single(received, rows, in_counts, out_counts, group)
    row_bytes = (rows.shape[1] if rows.dim() > 1 else 1) * rows.element_size()
    sent = off_rank(out_counts, self_index) * row_bytes
    record_all(ledgers, kind, sent, off_rank(in_counts, self_index) * row_bytes, sent if crosses_nodes else 0)
    return received


def _by_proxy(send_counts: List[int], groups: NodeGroups, device: torch.device) -> Tuple[torch.Tensor, List[int]]:
    """The permutation of the (owner-sorted) unique ids that groups them by the owner's
    local index (then node, then id: a stable sort), and how many go to each proxy."""
    t = groups.topology
    owners = torch.repeat_interleave(torch.arange(t.world_size, device=device),
                                     torch.tensor(send_counts, dtype=torch.long, device=device))
    local = torch.remainder(owners, t.ranks_per_node)
    order = torch.sort(local * t.num_nodes + torch.div(owners, t.ranks_per_node, rounding_mode="floor"),
                       stable=True).indices
    return order, torch.bincount(local, minlength=t.ranks_per_node).tolist()


def _header(counts: List[int], bad: Optional[Tuple[int, int]], device: torch.device) -> torch.Tensor:
    h = torch.zeros(len(counts), _HEADER_FIELDS, dtype=torch.long, device=device)
    h[:, 0] = torch.tensor(counts, dtype=torch.long)
    if bad is not None:
        h[:, 1] = 1
        h[:, 2], h[:, 3] = bad
    return h


def _swap_headers(header: torch.Tensor, group: collectives.Group, self_index: int, ledgers: List[CommLedger],
                  crosses_nodes: bool) -> Tuple[List[int], Optional[Tuple[int, int]]]:
    """AlltoAll the headers: the counts each peer sends, and the bad id of the lowest
    rank any peer flagged (the same on every rank once both hops are done)."""
    received = torch.empty_like(header)
    collectives.all_to_all_single(received, header, group=group)
    nbytes = (header.shape[0] - 1) * _HEADER_FIELDS * header.element_size()
    record_all(ledgers, K.COUNTS, nbytes, nbytes, nbytes if crosses_nodes else 0)
    flagged = received[:, 1].nonzero().flatten().tolist()
    bad = min(((int(received[k, 3]), int(received[k, 2])) for k in flagged), default=None)
    return received[:, 0].tolist(), None if bad is None else (bad[1], bad[0])


def plan_node_exchange(
    flat_ids: torch.Tensor,
    plan: ShardPlan,
    groups: NodeGroups,
    ledger: Optional[CommLedger] = None,
) -> NodeExchangePlan:
    """Dedup and bucket the ids, route them to the proxies of this node, dedup them per
    node and ask the owners over the rails.

    Collective over the whole job (every rank, also with an empty batch). Raises
    :class:`~embrace_fairseq.core.ids.InvalidIdError` on every rank if any rank holds an
    invalid id.
    """
    if flat_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"embedding ids must be an integer tensor, got {flat_ids.dtype}")
    t, rank = groups.topology, groups.rank
    if plan.world_size != t.world_size:
        raise ValueError(f"a table sharded over {plan.world_size} ranks in a job of {t.world_size}")
    ledgers = ledgers_for(ledger)
    mark_start(ledgers)  # a traced exchange starts here, however the lookup was called
    device = flat_ids.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    bucketed = native_ops.dedup_bucket(plan.to_plan(flat_ids), plan.boundaries)
    bad = None if bucketed.bad_id is None else (int(bucketed.bad_id), rank)
    if bad is None:
        unique_ids, inverse, send_counts = bucketed.unique_ids, bucketed.inverse, bucketed.send_counts
    else:
        unique_ids, inverse, send_counts = empty, empty, [0] * t.world_size
    order, node_send = _by_proxy(send_counts, groups, device)

    # node hop: counts (and error flags), then the ids, to the proxies of this node
    node_recv, bad_in_node = _swap_headers(_header(node_send, bad, device), groups.node_group, groups.local,
                                           ledgers, False)
    wire = wire_dtype(plan.num_embeddings)
    proxy_unique, proxy_inverse, rail_send = empty, empty, [0] * t.num_nodes
    if bad_in_node is None:  # every rank of the node saw the same flags: all skip, or none
        received = _exchange(unique_ids.index_select(0, order).to(wire), node_send, node_recv, groups.node_group,
                             groups.local, ledgers, K.IDS, False)
        # the node's requests merged: each id once, grouped by its owner's node (sorted plan
        # order puts the owners (0, j), (1, j), ... one after the other)
        proxy_unique, proxy_inverse = torch.unique(received.long(), sorted=True, return_inverse=True)
        bounds = torch.tensor(plan.boundaries[1:], dtype=torch.long, device=device)
        owners = torch.searchsorted(bounds, proxy_unique, right=True)
        rail_send = torch.bincount(torch.div(owners, t.ranks_per_node, rounding_mode="floor"),
                                   minlength=t.num_nodes).tolist()

    # rail hop: counts (and any flag of the proxy's node), then the node's unique ids
    rail_recv, bad_on_rail = _swap_headers(_header(rail_send, bad_in_node, device), groups.rail_group, groups.node,
                                           ledgers, True)
    if bad_on_rail is not None:  # the rail header carries every node's flag, this one's too
        bad_id, src = bad_on_rail
        raise InvalidIdError(
            invalid_id_message(bad_id, plan.num_embeddings, src)
            + (f" (raised on rank {rank} too, so no rank waits in a collective)" if src != rank else ""))
    asked = _exchange(proxy_unique.to(wire), rail_send, rail_recv, groups.rail_group, groups.node, ledgers, K.IDS,
                      True)
    start, _ = plan.shard_range(rank)
    return NodeExchangePlan(
        plan=plan,
        groups=groups,
        rank=rank,
        unique_ids=unique_ids,
        inverse=inverse,
        order=order,
        node_send=node_send,
        node_recv=node_recv,
        proxy_inverse=proxy_inverse,
        proxy_ids=int(proxy_unique.numel()),
        rail_send=rail_send,
        rail_recv=rail_recv,
        requested_local=asked.long() - start,
        ledgers=ledgers,
    )
