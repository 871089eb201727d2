"""Step cost of EmbRace: the AlltoAll exchange, without and with the 2D schedule.

Registered with the strategies in :mod:`embrace_fairseq.perf.strategies`. Both share
the traffic (:func:`traffic`); they differ in what overlaps what:

* ``noschedule``: the exchange before the forward, the gradient rows after the
  backward, then the dense all-reduce buckets, nothing overlapped;
* ``schedule``: one step on a priority link, steady state: the forward exchange first
  (the deferred rows of the previous step arrive with it), dense pieces issued during
  the backward input-near first, gradient rows the next batch reads urgent and the
  others deferred into the next forward;
* ``fifo``: the schedule's ablation baseline: whole dense buckets all-reduced during the
  backward in the order they become ready, every gradient row before the step;
* ``schedule_node``: ``schedule`` with the node-aware exchange (:func:`node_traffic`): each
  hop of the flat exchange becomes two, one inside the node and one along the rails, and
  what crosses between nodes is each node's union of ids instead of its ranks' sum.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

from embrace_fairseq.perf.simulator.link import dense_specs
from embrace_fairseq.planner.cost import HEADER_BYTES_PER_PEER, SOFTMAX_STAT_BYTES
from embrace_fairseq.planner.link import Job, ready_times, run_link
from embrace_fairseq.perf.simulator.prediction import CostContext, Prediction
from embrace_fairseq.schedule.plan import cut_pieces, make_buckets, readiness_order

NODE_HEADER_BYTES_PER_PEER = 4 * 8  # the node-aware exchange's, per hop: the same and the bad id's rank


@dataclass(frozen=True)
class EmbraceTraffic:
    """Seconds on the link of each EmbRace collective of one step (0 when absent)."""

    exchange_ids_s: float  # header and ids to the owners
    exchange_rows_s: float  # rows back to the requesters
    grad_rows_s: float  # gradient rows to the owners
    rows_busiest_bytes: float  # the busiest rank's row bytes (cut into urgent and deferred)
    rows_part_s: Callable[[float], float]  # a share of the gradient rows sent as one exchange
    gather_bytes: float  # tied output: the table all-gathered, shards padded to the largest
    table_gather_s: float
    table_grad_s: float  # tied output: the table gradient reduce-scattered
    vocab_parallel_fwd_s: float  # vocab-parallel output: hidden states and softmax statistics
    vocab_parallel_bwd_s: float  # and their gradients

    @property
    def exchange_s(self) -> float:
        return self.exchange_ids_s + self.exchange_rows_s

    def detail(self) -> Dict[str, float]:
        return {"exchange_fwd_s": self.exchange_s, "grad_rows_s": self.grad_rows_s,
                "table_gather_s": self.table_gather_s, "table_grad_s": self.table_grad_s}


def traffic(ctx: CostContext) -> EmbraceTraffic:
    """The flat exchange and the tied output's collectives. On nodes the exchange's NIC
    carries what its ranks send off the node together
    (:attr:`~embrace_fairseq.perf.simulator.sparse_loads.NodeLoads.flat_nic_rows`), not K
    times the busiest rank's: one rank serving the head of the vocabulary does not make
    its node's other ranks as busy."""
    prof, n, net = ctx.profile, ctx.world_size, ctx.net
    e, D, tied = prof.element_size, prof.dim, prof.tied_output
    busiest = ctx.loads.busiest_rows
    rows_busiest = busiest * D * e
    hdr = net.alltoall((n - 1) * HEADER_BYTES_PER_PEER, n)
    k = ctx.ranks_per_node
    # the busiest node's NIC rows per row of the busiest rank (None: no NIC shared)
    nic = ctx.node_loads.flat_nic_rows / busiest if 1 < k < n and busiest > 0 else None

    def exchange(nbytes: float) -> float:
        return net.alltoall(nbytes, n, None if nic is None else nic * nbytes)

    gather_bytes = n * -(-prof.vocab // n) * D * e
    out_tokens = prof.output_tokens_per_rank or prof.tokens_per_rank
    vp_fwd = vp_bwd = 0.0
    if tied == "vocab_parallel":
        vp_fwd = net.allgather(n * out_tokens * D * e, n) + net.allgather(n * out_tokens * SOFTMAX_STAT_BYTES, n)
        vp_bwd = net.reduce_scatter(n * out_tokens * D * e, n)
    return EmbraceTraffic(
        exchange_ids_s=hdr + exchange(busiest * prof.id_size),
        exchange_rows_s=exchange(rows_busiest),
        grad_rows_s=exchange(rows_busiest),
        rows_busiest_bytes=rows_busiest,
        rows_part_s=lambda part: exchange(rows_busiest * part),
        gather_bytes=gather_bytes,
        table_gather_s=net.allgather(gather_bytes, n) if tied == "gather" else 0.0,
        table_grad_s=net.reduce_scatter(prof.table_bytes, n) if tied == "gather" else 0.0,
        vocab_parallel_fwd_s=vp_fwd,
        vocab_parallel_bwd_s=vp_bwd,
    )


def node_traffic(ctx: CostContext) -> EmbraceTraffic:
    """:func:`traffic` with the node-aware exchange (:mod:`embrace_fairseq.core.node_exchange`).

    Ids go to the proxies inside the node, then the node's union along the rails; rows come
    back the other way and gradient rows follow the ids. The hops depend on each other, so
    their times add. Inside the node every rank's ids travel (its own local index's stay);
    across nodes only the union of its K ranks' ids, which is what the node-aware route
    saves: hot ids are drawn by several ranks of a node and cross once
    (:func:`~embrace_fairseq.perf.simulator.sparse_loads.node_loads`). One rank per node or
    one node: the library runs the flat exchange, and so does this (:func:`traffic`). The
    tied output's collectives are the flat ones'.
    """
    flat = traffic(ctx)
    n, net, k = ctx.world_size, ctx.net, ctx.ranks_per_node
    if k in (1, n):
        return flat
    prof, loads = ctx.profile, ctx.node_loads
    row_bytes = prof.dim * prof.element_size
    inside, rails = loads.node_hop_rows, loads.rail_rows
    nic = loads.rail_nic_rows / rails if rails > 0 else 0.0  # the NIC's rows per row of the busiest rail rank
    headers = (net.alltoall_inside((k - 1) * NODE_HEADER_BYTES_PER_PEER, n)
               + net.alltoall_rails((n // k - 1) * NODE_HEADER_BYTES_PER_PEER, n))

    def hops(bytes_inside: float, bytes_rails: float) -> float:  # of the busiest rank on each hop
        return net.alltoall_inside(bytes_inside, n) + net.alltoall_rails(bytes_rails, n, nic * bytes_rails)

    def rows_part_s(part: float) -> float:
        return hops(inside * row_bytes * part, rails * row_bytes * part)

    return replace(
        flat,
        exchange_ids_s=headers + hops(inside * prof.id_size, rails * prof.id_size),
        exchange_rows_s=rows_part_s(1.0),
        grad_rows_s=rows_part_s(1.0),
        rows_busiest_bytes=max(inside, rails) * row_bytes,
        rows_part_s=rows_part_s,
    )


def noschedule(ctx: CostContext) -> Prediction:
    t = traffic(ctx)
    specs = dense_specs(ctx.profile, False)
    buckets = make_buckets(specs, readiness_order(specs), ctx.opts.embrace_bucket_bytes)
    dense_comm = sum(ctx.net.allreduce(b.nbytes, ctx.world_size) for b in buckets)
    comm = (t.exchange_ids_s + t.exchange_rows_s + t.grad_rows_s + t.table_gather_s + t.table_grad_s
            + t.vocab_parallel_fwd_s + t.vocab_parallel_bwd_s + dense_comm)
    return ctx.not_overlapped(comm, dict(t.detail(), allreduce_s=dense_comm))


class _PriorityLink:
    """The step's collectives on one non-preemptive priority link."""

    def __init__(self) -> None:
        self.jobs: List[Job] = []

    def add(self, name: str, ready: float, total_bytes: float, cost: Callable[[float], float], prio: tuple) -> None:
        # one collective, as the implementation issues it (only dense buckets are cut)
        if total_bytes > 0:
            self.jobs.append(Job(name, ready, cost(total_bytes), prio))

    def run(self) -> Dict[str, Tuple[float, float]]:
        return run_link(self.jobs)


def _add_rows(link: _PriorityLink, t: EmbraceTraffic, name: str, ready: float, part: float, prio: tuple) -> None:
    """A share ``part`` of the step's gradient rows as one exchange (none when it is empty)."""
    if t.rows_busiest_bytes * part > 0:
        link.jobs.append(Job(name, ready, t.rows_part_s(part), prio))


def _forward(ctx: CostContext, t: EmbraceTraffic, link: _PriorityLink, share: float) -> float:
    """Queue the forward's collectives; when the backward can start."""
    n, net, overlap = ctx.world_size, ctx.net, ctx.opts.overlap_table
    link.jobs.append(Job("exchange", 0.0, t.exchange_s, (0,)))  # the forward waits for it
    _add_rows(link, t, "deferred", 0.0, 1 - share, (2,))
    if t.table_gather_s and overlap:  # prefetched while the forward runs
        link.add("gather", 0.0, t.gather_bytes, lambda b: net.allgather(b, n), (1,))
    spans = link.run()
    fwd_end = spans["exchange"][1] + ctx.forward_s + t.vocab_parallel_fwd_s
    if t.table_gather_s and overlap:
        return max(fwd_end, spans["gather"][1])
    if t.table_gather_s:  # as built: the output projection gathers the table when it runs
        link.add("gather", fwd_end, t.gather_bytes, lambda b: net.allgather(b, n), (0, 1))
        return link.run()["gather"][1]
    return fwd_end


def _backward(ctx: CostContext, t: EmbraceTraffic, link: _PriorityLink, bwd_start: float, share: float,
              fifo: bool = False) -> float:
    """Queue the backward's collectives; when the backward ends (stalls included).
    ``fifo``: whole buckets in readiness order instead of pieces input-near first."""
    prof, n, net, opts = ctx.profile, ctx.world_size, ctx.net, ctx.opts
    specs = dense_specs(prof, prof.tied_output == "gather")
    ready = ready_times(specs, ctx.backward_s)
    stall = 0.0
    if t.table_gather_s:  # the output projection's gradient is ready first
        t_out = bwd_start + ready[len(specs) - 1]
        if opts.overlap_table:  # needed only by the optimizer: least urgent
            link.add("table_grad", t_out, prof.table_bytes, lambda b: net.reduce_scatter(b, n), (5,))
        else:  # as built: the reduce-scatter runs inside the backward, which waits for it
            link.add("table_grad", t_out, prof.table_bytes, lambda b: net.reduce_scatter(b, n), (0, 2))
            stall = link.run()["table_grad"][1] - t_out
    # dense pieces in the static 2D order, input-near first
    layers = specs[: len(prof.dense_layers)]
    for b in make_buckets(layers, readiness_order(layers), opts.embrace_bucket_bytes):
        ready_at = bwd_start + stall + max(ready[i] for i in b.tensors)
        for p in cut_pieces(b, b.nbytes if fifo else opts.embrace_piece_bytes):
            prio = (4, ready_at, b.index) if fifo else (4, b.priority, b.index, p.index)
            link.jobs.append(Job(f"dense{b.index}.{p.index}", ready_at, net.allreduce(p.nbytes, n), prio))
    bwd_end = bwd_start + stall + ctx.backward_s + t.vocab_parallel_bwd_s
    _add_rows(link, t, "urgent_rows", bwd_end, share, (3,))
    return bwd_end


def fifo(ctx: CostContext) -> Prediction:
    return _overlapped(ctx, fifo=True)


def schedule(ctx: CostContext) -> Prediction:
    return _overlapped(ctx, fifo=False)


def auto(ctx: CostContext) -> Prediction:
    """The default plan: the cheaper of the 2D schedule's step and c10d's (nothing sharded:
    the stock path). The planner also keeps the stock step where sharding gains less than
    its margin, which its own model's missing exchange compute asks for; this model
    counts that compute."""
    from embrace_fairseq.perf.simulator.allreduce_costs import c10d

    sharded, stock = schedule(ctx), c10d(ctx)
    return sharded if sharded.step_s <= stock.step_s else stock


def schedule_node(ctx: CostContext) -> Prediction:
    """``schedule`` with the node-aware exchange: the same step, the exchange's collectives
    costed as two hops (:func:`node_traffic`); the flat one's where there are no nodes."""
    pred = _overlapped(ctx, fifo=False, t=node_traffic(ctx))
    k, n = ctx.ranks_per_node, ctx.world_size
    if k not in (1, n):
        loads = ctx.node_loads
        pred.detail.update(node_dedup_ratio=loads.dedup_ratio, node_unique_ids=loads.node_unique_mean,
                           node_hop_rows=loads.node_hop_rows, rail_rows=loads.rail_rows)
    return pred


def _overlapped(ctx: CostContext, fifo: bool, t: Optional[EmbraceTraffic] = None) -> Prediction:
    t = traffic(ctx) if t is None else t
    # rows the next step reads: urgent (all of them without the relaxed dependency)
    share = ctx.loads.next_step_share if ctx.opts.defer_rows and not fifo else 1.0
    link = _PriorityLink()
    bwd_start = _forward(ctx, t, link, share)
    bwd_end = _backward(ctx, t, link, bwd_start, share, fifo)
    end = max([bwd_end] + [s[1] for s in link.run().values()])
    step = end + ctx.optimizer_s
    comm = sum(j.duration for j in link.jobs) + t.vocab_parallel_fwd_s + t.vocab_parallel_bwd_s
    detail = dict(t.detail(), deferred_share=1 - share, busiest_rows=ctx.loads.busiest_rows)
    return ctx.prediction(step, comm, step - ctx.compute_s, detail)


def zero1(ctx: CostContext) -> Prediction:
    """EmbRace's exchange with the dense layers under DeepSpeed ZeRO-1: the exchange and the
    tied output's collectives block as without the schedule (the executor does not run:
    DeepSpeed reduces the dense gradients); the dense part costs what ZeRO-1's does
    without the table."""
    from embrace_fairseq.perf.simulator.allreduce_costs import zero_cost

    t = traffic(ctx)
    blocking = (t.exchange_s + t.grad_rows_s + t.table_gather_s + t.table_grad_s
                + t.vocab_parallel_fwd_s + t.vocab_parallel_bwd_s)
    return zero_cost(ctx, during_backward=False, with_table=False, blocking_s=blocking, detail=t.detail())
