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
  backward in the order they become ready, every gradient row before the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from embrace_fairseq.perf.simulator.link import Job, dense_specs, ready_times, run_link
from embrace_fairseq.perf.simulator.prediction import CostContext, Prediction
from embrace_fairseq.schedule.plan import cut_pieces, make_buckets, readiness_order

HEADER_BYTES_PER_PEER = 3 * 8  # the exchange header: count, error flag, bad id (int64)
SOFTMAX_STAT_BYTES = 2 * 4  # vocab-parallel output: max and sum per token, fp32


@dataclass(frozen=True)
class EmbraceTraffic:
    """Seconds on the link of each EmbRace collective of one step (0 when absent)."""

    exchange_ids_s: float  # header and ids to the owners
    exchange_rows_s: float  # rows back to the requesters
    grad_rows_s: float  # gradient rows to the owners
    rows_busiest_bytes: float  # the busiest rank's row bytes (cut into urgent and deferred)
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
    prof, n, net = ctx.profile, ctx.world_size, ctx.net
    e, D, tied = prof.element_size, prof.dim, prof.tied_output
    busiest = ctx.loads.busiest_rows
    rows_busiest = busiest * D * e
    hdr = net.alltoall((n - 1) * HEADER_BYTES_PER_PEER, n)
    gather_bytes = n * -(-prof.vocab // n) * D * e
    out_tokens = prof.output_tokens_per_rank or prof.tokens_per_rank
    vp_fwd = vp_bwd = 0.0
    if tied == "vocab_parallel":
        vp_fwd = net.allgather(n * out_tokens * D * e, n) + net.allgather(n * out_tokens * SOFTMAX_STAT_BYTES, n)
        vp_bwd = net.reduce_scatter(n * out_tokens * D * e, n)
    return EmbraceTraffic(
        exchange_ids_s=hdr + net.alltoall(busiest * prof.id_size, n),
        exchange_rows_s=net.alltoall(rows_busiest, n),
        grad_rows_s=net.alltoall(rows_busiest, n),
        rows_busiest_bytes=rows_busiest,
        gather_bytes=gather_bytes,
        table_gather_s=net.allgather(gather_bytes, n) if tied == "gather" else 0.0,
        table_grad_s=net.reduce_scatter(prof.table_bytes, n) if tied == "gather" else 0.0,
        vocab_parallel_fwd_s=vp_fwd,
        vocab_parallel_bwd_s=vp_bwd,
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


def _forward(ctx: CostContext, t: EmbraceTraffic, link: _PriorityLink, share: float) -> float:
    """Queue the forward's collectives; when the backward can start."""
    n, net, overlap = ctx.world_size, ctx.net, ctx.opts.overlap_table
    link.jobs.append(Job("exchange", 0.0, t.exchange_s, (0,)))  # the forward waits for it
    link.add("deferred", 0.0, t.rows_busiest_bytes * (1 - share), lambda b: net.alltoall(b, n), (2,))
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
    link.add("urgent_rows", bwd_end, t.rows_busiest_bytes * share, lambda b: net.alltoall(b, n), (3,))
    return bwd_end


def fifo(ctx: CostContext) -> Prediction:
    return _overlapped(ctx, fifo=True)


def schedule(ctx: CostContext) -> Prediction:
    return _overlapped(ctx, fifo=False)


def _overlapped(ctx: CostContext, fifo: bool) -> Prediction:
    t = traffic(ctx)
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
