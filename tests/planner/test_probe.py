"""The probe: rates measured on real gloo ranks are the same on every rank, and so is
the plan; ranks whose plans differ stop, each with the reason."""
from __future__ import annotations

import math

from embrace_fairseq.planner.probe import check_agreed, measure_rates
from embrace_fairseq.tools.local_ranks import run_ranks

from rank_fns_planner import TABLE, probe_and_plan


def test_rates_and_plan_agree_on_every_rank():
    results = run_ranks(probe_and_plan, 3, timeout_s=120)
    assert len({repr(r["rates"]) for r in results}) == 1, [r["rates"] for r in results]
    assert len({(r["spec"], r["schedule"]) for r in results}) == 1
    rates = results[0]["rates"]
    assert rates.link_bytes_per_s > 0 and rates.latency_s >= 0 and rates.compute_s > 0
    for r in results:
        assert r["disagreement"] and "different embedding plans" in r["disagreement"]


def test_a_world_of_one_has_no_link_to_measure():
    rates = measure_rates(1000, [TABLE], 16, 16)
    assert math.isinf(rates.link_bytes_per_s) and rates.compute_s > 0
    check_agreed("anything")  # nothing to agree with
