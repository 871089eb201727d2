"""Per-rank body of the fence-deadlock test: the single-thread issue mode on gloo ranks
whose graphs differ (rank 0 computes a layer that the others do not, as an adaptive
softmax's tail cluster), so that at the fence before a collective in backward rank 0
has issued a piece its peers have not; rank 0 then blocks on every collective it issued
before reaching the fence, as a device-wide synchronisation does on a GPU (its device
waits in that piece for the peers' halves)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

STEPS = 2


class _StallThenCollective(torch.autograd.Function):
    """An identity whose backward (on rank 0) first waits for every dense piece it issued
    and then issues a collective (as an embedding exchange does): its fence follows."""

    @staticmethod
    def forward(ctx, x, reducer, seen):
        ctx.reducer, ctx.seen = reducer, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        red = ctx.reducer
        ctx.seen.append(red._next)  # pieces issued from the hooks before the fence
        if collectives.rank() == 0:
            for pending, _ in list(red._inflight):
                pending.synchronize()  # the host blocks until the device has finished them
        collectives.all_reduce(torch.zeros(1))
        return grad, None, None


def _layers():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))  # first, tail, second


def _loss(layers, x, rank, fence=None):
    h = layers[0](x)
    if fence is not None:
        h = _StallThenCollective.apply(h, *fence)
    if rank == 0:  # the tail: no gradient on the other ranks
        h = torch.tanh(layers[1](h))
    return layers[2](h).pow(2).sum()


def stall_before_fence(rank: int, world: int) -> Dict[str, Any]:
    layers = _layers()
    params = list(layers.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i // 2) for i, p in enumerate(params)]
    opts = ScheduleOptions(piece_bytes=64, bucket_bytes=64, max_in_flight=8, compute_bytes_per_s=1e9,
                           link_bytes_per_s=1e9)
    red = ScheduledAllReduce(params, build_schedule(specs, opts), collectives.new_group(), single_thread=True)
    ref = _layers()
    seen: List[int] = []
    reduced, local = [], []
    for step in range(STEPS):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        _loss(layers, x, rank, fence=(red, seen)).backward()
        red.finish()
        reduced.append([p.grad.tolist() for p in params])  # plain lists: the ranks exit
        _loss(ref, x, rank).backward()
        local.append([(p.grad if p.grad is not None else torch.zeros_like(p)).tolist() for p in ref.parameters()])
        for p in [*params, *ref.parameters()]:
            p.grad = None
    return {"reduced": reduced, "local": local, "issued_before_fence": seen, "fence_rounds": red.fence_rounds,
            "no_grad_last_step": red.no_grad_last_step}
