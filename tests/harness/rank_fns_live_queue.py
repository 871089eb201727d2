"""Per-rank bodies of the live-queue tests: a small model whose backward sleeps between
layers (a known readiness pattern), reduced by ``ScheduledAllReduce``'s communication
thread in real gloo ranks, against the plain average of every rank's gradients."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core.trace import Tracer
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

DIM, LAYERS = 64, 4


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Branches(torch.nn.Module):
    """``LAYERS`` linear layers; ``sequential``: one chain (readiness: last layer first);
    else parallel branches summed, created in ``branch_order``, each sleeping
    ``sleeps[i]`` in its backward: the order their gradients become ready is set per rank."""

    def __init__(self, sequential: bool, sleeps: List[float], branch_order: Optional[List[int]] = None) -> None:
        super().__init__()
        self.branch_order = branch_order
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.sequential, self.sleeps = sequential, sleeps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            for layer, s in zip(self.layers, self.sleeps):
                x = _SleepInBackward.apply(torch.tanh(layer(x)), s)
            return x
        # autograd runs the branch created last first: the creation order sets the
        # order their gradients become ready
        order = self.branch_order or range(LAYERS)
        return sum(_SleepInBackward.apply(self.layers[i](x), self.sleeps[i]) for i in order)


def _reduce(rank: int, world: int, *, sequential: bool, sleeps: List[float], overlap: bool,
            model_level: bool = True, branch_order: Optional[List[int]] = None,
            compute_bytes_per_s: Optional[float] = 1e15) -> Dict[str, Any]:
    model = Branches(sequential, sleeps, branch_order)
    params = list(model.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i // 2) for i, p in enumerate(params)]
    # one bucket per layer (weight + bias), two pieces each, one collective in flight;
    # rates that call backward instantaneous: the static list puts the input layer first
    opts = ScheduleOptions(bucket_bytes=(DIM * DIM + DIM) * 4, piece_bytes=(DIM * DIM + DIM) * 2,
                           max_in_flight=1, model_level=model_level, compute_bytes_per_s=compute_bytes_per_s)
    schedule = build_schedule(specs, opts)
    tracer = Tracer(rank=rank)
    red = ScheduledAllReduce(params, schedule, collectives.new_group(), overlap=overlap, tracer=tracer,
                             single_thread=False, live_queue=True)
    x = torch.randn(16, DIM, generator=torch.Generator().manual_seed(100 + rank))
    ready: List[int] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready.append(i // 2))
    model(x).square().sum().backward()
    local = [p.grad.clone() for p in params]
    red.finish()
    expect = [collectives.all_reduce(g.clone()) / world for g in local]
    err = max(float((p.grad - e).abs().max()) for p, e in zip(params, expect))
    layer_of_bucket = {b.index: sorted({t // 2 for t in b.tensors}) for b in schedule.buckets}
    return {"max_err": err, "events": tracer.events(), "layer_of_bucket": layer_of_bucket,
            "static_order": [p.bucket for p in schedule.issue_order], "rounds": red.agreement_rounds,
            "pieces": len(schedule.issue_order), "buckets": len(schedule.buckets),
            "layers_ready": list(dict.fromkeys(ready)), "rates": red.rates,
            "options_rates": (schedule.options.compute_bytes_per_s, schedule.options.link_bytes_per_s),
            "static_after": [(p.bucket, p.index) for p in schedule.issue_order]}


def ready_early(rank: int, world: int) -> Dict[str, Any]:
    """A chain whose backward takes 0.25 s per layer: the output layer's gradient is
    ready ~0.75 s before the input layer's."""
    return _reduce(rank, world, sequential=True, sleeps=[0.25] * LAYERS, overlap=True)


def after_backward(rank: int, world: int, model_level: bool) -> Dict[str, Any]:
    """Everything ready at once (overlap off): the queue decides the whole order."""
    return _reduce(rank, world, sequential=True, sleeps=[0.0] * LAYERS, overlap=False, model_level=model_level)


def crossed_orders(rank: int, world: int) -> Dict[str, Any]:
    """Parallel branches whose gradients complete in a different order on each rank."""
    order = [(i + rank) % LAYERS for i in range(LAYERS)]
    # rates not configured: measured (the link at start-up, backward over this step)
    return _reduce(rank, world, sequential=False, sleeps=[0.1] * LAYERS, overlap=True, branch_order=order,
                   compute_bytes_per_s=None)


def two_rank_cases(rank: int, world: int) -> Dict[str, Any]:
    """Every two-rank case in one spawn of the ranks."""
    return {"ready_early": ready_early(rank, world), "priority": after_backward(rank, world, True),
            "readiness": after_backward(rank, world, False)}
