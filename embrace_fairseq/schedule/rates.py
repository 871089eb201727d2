"""The two rates the static issue list is simulated with, measured on the ranks themselves.

The static list (what the autograd-thread issue mode follows, see the executor) is only as
good as its estimate of when each gradient is ready and how long each piece takes; the
ratio of backward speed to link speed decides whether an urgent bucket is worth waiting
for. Both are measured where they are not set in the configuration:

* the link: a timed all-reduce of one piece at start-up, on the device the group uses,
  the slowest rank's time (what every rank waits for);
* backward: gradient bytes over the time from the first gradient hook to the end of the
  first reduced backward (device events on CUDA, not the host's enqueue times), the
  slowest rank's rate; measured again, warm, at a later step (the executor's
  ``WARM_STEP``), whose figure replaces the cold one.

Every rank then holds the same reduced figures, so every rank re-simulates the same list.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from embrace_fairseq.core import collectives

from embrace_fairseq.schedule.plan import ScheduleOptions

#: the rates assumed before a measurement exists (and without a process group)
DEFAULT_COMPUTE_BYTES_PER_S = ScheduleOptions.ASSUMED_COMPUTE_BYTES_PER_S
DEFAULT_LINK_BYTES_PER_S = ScheduleOptions.ASSUMED_LINK_BYTES_PER_S


def slowest_seconds(seconds: float, group: collectives.Group = None) -> float:
    """The largest of every rank's ``seconds`` (collective; a lone process: its own).

    >>> slowest_seconds(0.25)
    0.25
    """
    if collectives.world_size(group) <= 1:
        return float(seconds)
    t = torch.tensor([float(seconds)], dtype=torch.float64)
    collectives.all_reduce(t, op="max", group=group)
    return float(t.item())


def measure_link_bytes_per_s(nbytes: int, group: collectives.Group = None, repeats: int = 2,
                             device: Optional[torch.device] = None) -> float:
    """All-reduce throughput in payload bytes per second (what a piece of that size
    takes, latency included), from ``repeats`` timed
    all-reduces of ``nbytes`` after one untimed (collective; same call on every rank).
    The buffer lives where the group runs a tensor of ``device`` (the dense gradients'
    device; CPU by default), so no staging copy is timed; on CUDA the timer waits for
    the device before and after.

    >>> measure_link_bytes_per_s(1 << 16) >= DEFAULT_LINK_BYTES_PER_S  # one process: no link
    True
    """
    world = collectives.world_size(group)
    if world <= 1:
        return DEFAULT_LINK_BYTES_PER_S
    where = collectives.device_for(group, device if device is not None else "cpu")
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=where)
    collectives.all_reduce(buf, group=group)
    _device_sync(where)
    t0 = time.perf_counter()
    for _ in range(repeats):
        collectives.all_reduce(buf, group=group)
    _device_sync(where)  # NCCL's all-reduce returns once enqueued
    elapsed = slowest_seconds((time.perf_counter() - t0) / repeats, group)
    # payload bytes, as the simulation charges a piece (not the ring's wire bytes)
    return buf.numel() * 4 / max(elapsed, 1e-9)


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backward_bytes_per_s(grad_bytes: int, seconds: Optional[float], group: collectives.Group = None) -> float:
    """Gradient bytes per second of the slowest rank's backward (collective)."""
    slowest = slowest_seconds(seconds if seconds is not None else 0.0, group)
    if slowest <= 0:
        return DEFAULT_COMPUTE_BYTES_PER_S
    return grad_bytes / slowest
