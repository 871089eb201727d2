"""The communication thread's live priority queue, in real gloo ranks: ready pieces go
out without waiting for an earlier one of the static list that is not ready; when
several are ready the most urgent goes first; ranks whose buckets complete in different
orders still pair the same collectives and get the plain average; rates the options
leave unset are measured, alike on every rank."""
import pytest

import rank_fns_live_queue as R
from embrace_fairseq.tools.local_ranks import run_ranks


def _issues(res):
    """(issue time, bucket) of every dense piece, in issue order."""
    return sorted((e["ts"], e["args"]["bucket"]) for e in res["events"] if e["name"] == "dense_grad")


def _ready_ts(res):
    (ts,) = [e["ts"] for e in res["events"] if e["name"] == "gradients_ready"]
    return ts


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(R.two_rank_cases, 2, timeout_s=180)


def test_a_ready_piece_does_not_wait_for_an_unready_earlier_one(two_ranks):
    for res in (r["ready_early"] for r in two_ranks):
        assert res["max_err"] < 1e-5
        input_bucket = next(b for b, layers in res["layer_of_bucket"].items() if layers == [0])
        output_bucket = next(b for b, layers in res["layer_of_bucket"].items() if layers == [R.LAYERS - 1])
        middle_bucket = next(b for b, layers in res["layer_of_bucket"].items() if layers == [R.LAYERS - 2])
        # the static list makes the middle layer's pieces wait for the input layer, ready last
        static = res["static_order"]
        assert static.index(input_bucket) < static.index(middle_bucket), static
        issues = _issues(res)
        assert len(issues) == res["pieces"]
        assert issues[0][1] == output_bucket
        # live: the output and the middle layers' pieces went out while backward still ran
        ready = _ready_ts(res)
        assert ready - min(ts for ts, b in issues if b == output_bucket) > 0.5e6, (issues, ready)
        assert ready - min(ts for ts, b in issues if b == middle_bucket) > 0.25e6, (issues, ready)
        # one agreement round per bucket at most, plus one per piece
        assert res["rounds"] <= res["buckets"] + res["pieces"]


@pytest.mark.parametrize("case", ["priority", "readiness"])
def test_the_most_urgent_ready_piece_goes_first(two_ranks, case):
    for res in (r[case] for r in two_ranks):
        assert res["max_err"] < 1e-5
        layers = [res["layer_of_bucket"][b][0] for _, b in _issues(res)]
        # all ready at once: input layer first with the model level, readiness order without
        expect = sorted(layers) if case == "priority" else sorted(layers, reverse=True)
        assert layers == expect, layers


def test_ranks_with_different_readiness_orders_agree():
    results = run_ranks(R.crossed_orders, 3, timeout_s=120)
    # the layers' gradients really became ready in a different order on each rank
    assert len({tuple(res["layers_ready"]) for res in results}) == 3, [res["layers_ready"] for res in results]
    orders = [[b for _, b in _issues(res)] for res in results]
    assert all(o == orders[0] for o in orders), orders
    for res in results:
        assert res["max_err"] < 1e-5
    # the unset rates were measured, the same on every rank, and the static list re-simulated alike
    backward, link = results[0]["rates"]
    assert 0 < link < 1e12 and 0 < backward < 1e12, results[0]["rates"]
    # four 0.1 s sleeps in a backward of ~66 kB of gradients: well under 1 MB/s
    assert backward < 1e6, backward
    for res in results:
        assert res["rates"] == results[0]["rates"] == res["options_rates"]
        assert res["static_after"] == results[0]["static_after"]
