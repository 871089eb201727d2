"""A link that changes under a running job (the benchmark's emulated links between rounds):
:meth:`ScheduledAllReduce.remeasure_link` simulates the static list again for the link
measured now. The measurement is replaced by fixed rates here (a one-rank group has no
link to time); the list it leads to is the plan's own simulation with those rates."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from embrace_fairseq.schedule import rates
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

LAYERS = 6
# one tensor per bucket and per piece; backward makes one ready every millisecond
OPTS = ScheduleOptions(piece_bytes=1024, bucket_bytes=1024, max_in_flight=1, compute_bytes_per_s=1.024e6)


def _reducer(opts: ScheduleOptions = OPTS) -> ScheduledAllReduce:
    params = [torch.nn.Parameter(torch.zeros(256)) for _ in range(LAYERS)]
    specs = [TensorSpec(f"layer{i}", 256, 4, position=i) for i in range(LAYERS)]
    return ScheduledAllReduce(params, build_schedule(specs, opts), None)


def _buckets(red: ScheduledAllReduce) -> list:
    return [p.bucket for p in red.schedule.issue_order]


def test_a_slower_link_reorders_the_list_input_near_first(gloo1, monkeypatch):
    links = iter([1e12, 1e3])  # start-up: a link a billion times faster than the next one
    monkeypatch.setattr(rates, "measure_link_bytes_per_s", lambda *a, **k: next(links))
    red = _reducer()
    # buckets are numbered in readiness order (output-near first): on a fast link each
    # goes as soon as it is ready
    assert _buckets(red) == list(range(LAYERS))
    red.remeasure_link()
    assert red.rates == (OPTS.compute_bytes_per_s, 1e3)
    # on the slow link the first ready piece holds it while the others become ready; then
    # the most input-near goes first
    assert _buckets(red) == [0, 5, 4, 3, 2, 1]
    expected = build_schedule(red.schedule.tensors, replace(OPTS, link_bytes_per_s=1e3))
    assert red.schedule.issue_order == expected.issue_order


def test_a_configured_link_is_not_measured_again(gloo1, monkeypatch):
    red = _reducer(replace(OPTS, link_bytes_per_s=1e3))
    before = list(red.schedule.issue_order)

    def measured(*a, **k):
        raise AssertionError("the configured rate is the link's: nothing to measure")

    monkeypatch.setattr(rates, "measure_link_bytes_per_s", measured)
    red.remeasure_link()
    assert red.schedule.issue_order == before and red.rates[1] == 1e3


def test_not_while_a_deferred_all_reduce_runs(gloo1, monkeypatch):
    monkeypatch.setattr(rates, "measure_link_bytes_per_s", lambda *a, **k: 1e9)
    red = _reducer()
    for p in red.params:
        p.grad = torch.ones_like(p)
    red.defer()  # the step left its all-reduce running into the next forward
    with pytest.raises(RuntimeError, match="drain it first"):
        red.remeasure_link()
    for b in range(len(red.schedule.buckets)):
        red.wait_bucket(b)
    red.drain()
    red.remeasure_link()
