"""The dense all-reduce divides each rank's half-precision gradient by the world size
before the sum, as DDP's default hook does: real gloo ranks whose fp16 gradients sum to
more than half precision holds (65504) get their finite average. Two ranks run in the
default suite inside ``tests/core/test_collectives.py::test_async_inputs_live_until_wait_on_real_ranks``
(one start-up of ranks); three here."""
import math

import pytest

from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_collectives


def test_fp16_average_does_not_overflow_where_the_sum_would_three_ranks():
    value = 30000.0  # three ranks: the sum 90000 is inf in fp16; 10000 each, exact, sums to 30000
    out = run_ranks(rank_fns_collectives.fp16_headroom, 3, value)
    for r in out:
        assert all(math.isfinite(g) for g in r["grad"]), r
        assert r["grad"] == [value] * 8, r
