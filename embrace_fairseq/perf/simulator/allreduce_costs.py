"""Step cost of the stock strategies: gradients all-reduced (or all-gathered) whole.

Registered with the strategies in :mod:`embrace_fairseq.perf.strategies`; each
function takes a :class:`~.prediction.CostContext` and returns a prediction.
"""
from __future__ import annotations

from typing import Dict, Optional

from embrace_fairseq.perf.simulator.link import dense_specs
from embrace_fairseq.planner.link import Job, flat_buckets, ready_times, run_link
from embrace_fairseq.perf.simulator.prediction import CostContext, Prediction
from embrace_fairseq.schedule.plan import TensorSpec, make_buckets

INT64_BYTES = 8.0  # DeepSpeed gathers sizes and sparse indices as int64


def _flat_allreduce(ctx: CostContext, cap_numel: int) -> Prediction:
    """Backward, then every parameter (the table first: registration order) all-reduced
    in flat buffers of up to ``cap_numel`` elements, then the optimizer."""
    e, n = ctx.profile.element_size, ctx.world_size
    buckets = flat_buckets([ctx.table_numel] + ctx.dense_numels, cap_numel)
    comm = sum(ctx.net.allreduce(b * e, n) for b in buckets)
    return ctx.not_overlapped(comm, {"allreduce_s": comm})


def legacy_ddp(ctx: CostContext) -> Prediction:
    return _flat_allreduce(ctx, ctx.opts.legacy_ddp_buffer_numel)


def deepspeed(ctx: CostContext) -> Prediction:
    return _flat_allreduce(ctx, ctx.opts.deepspeed_bucket_numel)


def floor(ctx: CostContext) -> Prediction:
    """The compute-only floor: forward, backward and the optimizer, nothing on the link."""
    return ctx.not_overlapped(0.0, {})


def zero_cost(ctx: CostContext, during_backward: bool, with_table: bool = True, blocking_s: float = 0.0,
              detail: Optional[Dict[str, float]] = None) -> Prediction:
    """DeepSpeed ZeRO as the baselines run it: gradient buckets all-reduced (DeepSpeed's
    default reduction), after the backward (stage 1) or in readiness order during it
    (stage 2, ``overlap_comm``); each rank steps 1/N of the optimizer state; the updated
    partitions all-gathered in buckets. ``with_table`` False: the table is not DeepSpeed's
    (EmbRace's shards); ``blocking_s``: other communication the step waits for, not
    overlapped (EmbRace's exchange), with its parts in ``detail``."""
    if during_backward and not with_table:
        raise ValueError("ZeRO-2 is modelled with the table only: sharded tables run at ZeRO stage 0 or 1")
    e, n, net = ctx.profile.element_size, ctx.world_size, ctx.net
    F, B, O = ctx.forward_s, ctx.backward_s, ctx.optimizer_s / max(1, n)
    cap = ctx.opts.zero_bucket_numel
    numels = ([ctx.table_numel] if with_table else []) + ctx.dense_numels
    gather = sum(net.allgather(b * e, n) for b in flat_buckets(numels, cap))
    if during_backward:
        specs = [TensorSpec("embed_tokens", ctx.table_numel, e, 0)] + dense_specs(ctx.profile, False)
        ready = ready_times(specs[1:], B)
        ready_all = {0: B, **{i + 1: t for i, t in ready.items()}}
        order = sorted(range(len(specs)), key=lambda i: (ready_all[i], -i))
        jobs = [Job(f"b{b.index}", F + max(ready_all[i] for i in b.tensors), net.allreduce(b.nbytes, n), (b.index,))
                for b in make_buckets(specs, order, cap * e)]
        reduce_end = max([F + B] + [s[1] for s in run_link(jobs).values()])
        reduce = sum(j.duration for j in jobs)
    else:
        reduce = sum(net.allreduce(b * e, n) for b in flat_buckets(numels, cap))
        reduce_end = F + B + reduce
    step = reduce_end + blocking_s + O + gather
    comm = reduce + gather + blocking_s
    compute = F + B + O  # the optimizer's share of this rank: 1/N of the state
    return Prediction(ctx.strategy, n, step, compute, comm, step - compute,
                      dict(detail or {}, allreduce_s=reduce, allgather_s=gather))


def zero1(ctx: CostContext) -> Prediction:
    return zero_cost(ctx, during_backward=False)


def zero2(ctx: CostContext) -> Prediction:
    return zero_cost(ctx, during_backward=True)


def c10d(ctx: CostContext) -> Prediction:
    """torch DDP: buckets all-reduced in readiness order while the backward runs; the
    table is used at the input (and at the output when tied), so it is ready last."""
    F, B, O = ctx.forward_s, ctx.backward_s, ctx.optimizer_s
    n, net = ctx.world_size, ctx.net
    specs = [TensorSpec("embed_tokens", ctx.table_numel, ctx.profile.element_size, 0)] + dense_specs(ctx.profile, False)
    ready = ready_times(specs[1:], B)
    ready_all = {0: B, **{i + 1: t for i, t in ready.items()}}
    order = sorted(range(len(specs)), key=lambda i: (ready_all[i], -i))
    buckets = make_buckets(specs, order, ctx.opts.c10d_bucket_bytes)
    jobs = [
        Job(f"b{b.index}", F + max(ready_all[i] for i in b.tensors), net.allreduce(b.nbytes, n), (b.index,))
        for b in buckets
    ]
    spans = run_link(jobs)
    end = max([F + B] + [s[1] for s in spans.values()])
    comm = sum(j.duration for j in jobs)
    step = end + O
    return ctx.prediction(step, comm, step - ctx.compute_s, {})


def sparse_allgather(ctx: CostContext) -> Prediction:
    """Dense gradients all-reduced as DeepSpeed does; the table's coalesced sparse
    gradient all-gathered (sizes, int64 indices, values; blocks padded to the largest).
    A tied output projection makes the table's gradient dense: all-reduced."""
    prof, n, net = ctx.profile, ctx.world_size, ctx.net
    e, D = prof.element_size, prof.dim
    dense_comm = sum(net.allreduce(b * e, n) for b in flat_buckets(ctx.dense_numels, ctx.opts.deepspeed_bucket_numel))
    if prof.tied_output is not None:
        sparse = net.allreduce(prof.table_bytes, n)
    else:
        umax = ctx.loads.unique_max
        sparse = 2 * net.allgather(INT64_BYTES * n, n)  # sizes, twice (indices, values)
        sparse += net.allgather(n * umax * INT64_BYTES, n)  # int64 indices, padded to the largest
        sparse += net.allgather(n * umax * D * e, n)  # gradient rows, padded
    return ctx.not_overlapped(dense_comm + sparse, {"allreduce_s": dense_comm, "sparse_s": sparse})
