"""The backward rate the static list is simulated with is measured at the first reduced
step and again, warm, at the executor's ``WARM_STEP``: a first backward slowed by a cold
start (on a GPU its kernels load; seconds on an H200 for a small model) does not order
the pieces for the whole run. A one-rank gloo group; the link's measurement is fixed."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from embrace_fairseq.schedule import rates
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

DIM = 64
OPTS = ScheduleOptions(piece_bytes=DIM * DIM * 4, bucket_bytes=DIM * DIM * 4, max_in_flight=1)


class _Pause(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``: between the two layers' gradients."""

    seconds = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(_Pause.seconds)
        return g


def test_a_cold_first_backward_is_measured_again_warm(gloo1, monkeypatch):
    monkeypatch.setattr(rates, "measure_link_bytes_per_s", lambda *a, **k: 1e9)
    layers = [torch.nn.Linear(DIM, DIM, bias=False) for _ in range(2)]
    params = [l.weight for l in layers]
    specs = [TensorSpec(f"layer{i}", DIM * DIM, 4, position=i) for i in range(2)]
    red = ScheduledAllReduce(params, build_schedule(specs, OPTS), None)
    x = torch.randn(8, DIM)
    seen = []
    for step in range(1, ScheduledAllReduce.WARM_STEP + 2):
        _Pause.seconds = 1.0 if step == 1 else 0.0  # the cold start
        layers[1](_Pause.apply(layers[0](x))).square().sum().backward()
        red.finish()
        seen.append(red.rates[0])
    cold, warm = seen[0], seen[ScheduledAllReduce.WARM_STEP - 1]
    grad_bytes = 2 * DIM * DIM * 4
    assert cold <= grad_bytes / 1.0  # the pause is inside the measured backward
    assert seen[1:ScheduledAllReduce.WARM_STEP - 1] == [cold] * (ScheduledAllReduce.WARM_STEP - 2)
    # measured again without the pause (a warm backward of 200 ms at most: a loaded machine's)
    assert warm > 5 * cold
    assert seen[-1] == warm  # and not after that
    # the list is the plan's own simulation at the warm rate
    expected = build_schedule(specs, replace(OPTS, compute_bytes_per_s=warm, link_bytes_per_s=1e9))
    assert red.schedule.issue_order == expected.issue_order
