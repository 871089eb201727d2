"""One link shared by the collectives of a step: jobs, buckets and readiness times.

The collectives of a step run one at a time on one non-preemptive priority link; the
backward is split over the tensors in proportion to their size, so a tensor's gradient
is ready once the tensors after it are done. Pure arithmetic, used by the planner's cost
model (:mod:`.cost`) and the simulator (:mod:`embrace_fairseq.perf.simulator`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from embrace_fairseq.schedule.plan import TensorSpec, readiness_order


@dataclass
class Job:
    """One collective on the link: ready at ``ready``, lower ``priority`` tuples first."""

    name: str
    ready: float
    duration: float
    priority: tuple


def run_link(jobs: Sequence[Job]) -> Dict[str, Tuple[float, float]]:
    """One link, non-preemptive: whenever free, the most urgent ready job goes (ties: the
    earlier ready, then the order given). A heap of the ready jobs: thousands of pieces
    cost milliseconds."""
    pending = sorted(jobs, key=lambda j: (j.ready, j.priority))
    spans: Dict[str, Tuple[float, float]] = {}
    ready: List[Tuple[tuple, float, int]] = []
    now, i = 0.0, 0
    while i < len(pending) or ready:
        while i < len(pending) and pending[i].ready <= now:
            heapq.heappush(ready, (pending[i].priority, pending[i].ready, i))
            i += 1
        if not ready:
            now = pending[i].ready
            continue
        job = pending[heapq.heappop(ready)[2]]
        spans[job.name] = (now, now + job.duration)
        now += job.duration
    return spans


def ready_times(specs: Sequence[TensorSpec], backward_s: float) -> Dict[int, float]:
    """When each tensor's gradient is ready, the backward split by size (output first)."""
    total = sum(s.numel for s in specs) or 1
    t, out = 0.0, {}
    for i in readiness_order(specs):
        t += backward_s * specs[i].numel / total
        out[i] = t
    return out


def flat_buckets(numels: Iterable[int], cap: int) -> List[int]:
    """Elements per flat buffer when consecutive tensors fill buffers of up to ``cap``."""
    buckets, cur = [], 0
    for n in numels:
        if cur and cur + n > cap:
            buckets.append(cur)
            cur = 0
        cur += n
    if cur:
        buckets.append(cur)
    return buckets

