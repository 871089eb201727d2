"""The rates a plan is decided from, measured on the ranks at model build, the same on
every rank.

* the link: a few timed all-reduces of a small and a larger buffer on the group (the
  small one's time is the latency, the difference the bandwidth);
* the compute: where the caller gives a step (the adapters run the stock model's forward
  and backward on a made-up batch of the run's shape), that step timed: the compute floor
  itself, with whatever the ranks' shared cores and memory make of it. Without one, a
  timed matrix product of the model's width, whose FLOP rate prices a step at 6 FLOPs per
  parameter per token (2 forward, 4 backward) plus the output layer over its tokens; small
  products run far below the rate a whole step reaches, so this is the fallback only.

Each rank's three times are reduced to the slowest (one all-reduce, max), so every rank
holds identical :class:`~.inputs.Rates` and so chooses the identical plan;
:func:`check_agreed` confirms it. The figures are fixed for the run: a new plan needs a
restart. The probe moves a few MB and takes well under a second.
"""
from __future__ import annotations

import time
import zlib
from typing import Callable, Optional, Sequence

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.ring_volume import ring_allreduce_bytes
from embrace_fairseq.planner.inputs import Rates, TableInput

SMALL_BYTES = 4 << 10
LARGE_BYTES = 4 << 20
REPEATS = 3
#: a timed step repeats until it has run this long (at least once, at most STEP_REPEATS)
STEP_BUDGET_S = 0.5
STEP_REPEATS = 5
MATMUL_TOKENS = 512
TRAIN_FLOPS_PER_PARAM_TOKEN = 6.0


class PlanDisagreement(UserError, RuntimeError):
    """The ranks chose different plans (their inputs differ: another model or world)."""


def step_flops(dense_numel: int, tables: Sequence[TableInput], tokens_per_rank: int) -> float:
    """Training FLOPs of one step on one rank: the dense parameters over every token, each
    output layer over its tokens (lookups cost no FLOPs)."""
    out = sum(t.numel * t.output_tokens_per_rank for t in tables if t.is_output)
    return TRAIN_FLOPS_PER_PARAM_TOKEN * (dense_numel * tokens_per_rank + out)


def _timed(fn: Callable[[], None], device: torch.device, repeats: int = REPEATS) -> float:
    fn()  # untimed: first-call set-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one ``step`` (forward and backward): one untimed call (first-call set-up,
    the allocator's first blocks), then the mean of as many as fit :data:`STEP_BUDGET_S`."""
    step()
    _sync(device)
    t0, n = time.perf_counter(), 0
    while n < STEP_REPEATS and (n == 0 or time.perf_counter() - t0 < STEP_BUDGET_S):
        step()
        _sync(device)
        n += 1
    return (time.perf_counter() - t0) / n


def flops_compute_s(dense_numel: int, tables: Sequence[TableInput], tokens_per_rank: int, dim: int,
                    device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """A step's compute from a matrix product's FLOP rate (the fallback)."""
    a = torch.randn(MATMUL_TOKENS, dim, device=device, dtype=dtype)
    b = torch.randn(dim, dim, device=device, dtype=dtype)
    matmul_s = _timed(lambda: torch.mm(a, b), device)
    flops_per_s = 2.0 * MATMUL_TOKENS * dim * dim / max(matmul_s, 1e-9)
    return step_flops(dense_numel, tables, tokens_per_rank) / flops_per_s


def measure_rates(dense_numel: int, tables: Sequence[TableInput], tokens_per_rank: int, dim: int,
                  group: collectives.Group = None, device: Optional[torch.device] = None,
                  dtype: torch.dtype = torch.float32, step: Optional[Callable[[], None]] = None) -> Rates:
    """The slowest rank's link and compute (collective on ``group``; same call on every rank).
    ``step``: one forward and backward of the model with no communication, timed as the
    compute (else :func:`flops_compute_s`). Every rank times its own at the same moment,
    as the training steps will run."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    source = "step" if step is not None else "flops"
    if step is not None:
        compute_s = timed_step(step, device)
    else:
        compute_s = flops_compute_s(dense_numel, tables, tokens_per_rank, dim, device, dtype)
    n = collectives.world_size(group)
    if n <= 1:
        return Rates(link_bytes_per_s=float("inf"), latency_s=0.0, compute_s=compute_s, compute_from=source)
    where = collectives.device_for(group, device)
    small = torch.zeros(SMALL_BYTES // 4, device=where)
    large = torch.zeros(LARGE_BYTES // 4, device=where)
    t_small = _timed(lambda: collectives.all_reduce(small, group=group), where)
    t_large = _timed(lambda: collectives.all_reduce(large, group=group), where)
    times = torch.tensor([t_small, t_large, compute_s], dtype=torch.float64)
    collectives.all_reduce(times, op="max", group=group)
    t_small, t_large, compute_s = (float(x) for x in times)
    latency = t_small / (2 * (n - 1))
    wire = ring_allreduce_bytes(LARGE_BYTES, n) - ring_allreduce_bytes(SMALL_BYTES, n)
    return Rates(link_bytes_per_s=wire / max(t_large - t_small, 1e-9), latency_s=latency, compute_s=compute_s,
                 compute_from=source)


def check_agreed(key: str, group: collectives.Group = None) -> None:
    """Stop when the ranks' plans differ (collective): the plan's text, hashed, must be
    the same number on every rank."""
    if collectives.world_size(group) <= 1:
        return
    h = float(zlib.crc32(key.encode()))
    t = torch.tensor([h, -h], dtype=torch.float64)
    collectives.all_reduce(t, op="max", group=group)
    if t[0].item() != -t[1].item():
        raise PlanDisagreement(f"the ranks chose different embedding plans (this rank: {key}); every rank must "
                               "build the same model on the same world")
