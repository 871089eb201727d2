"""The benchmark report on several ranks per node: per-node accounting of the ranks'
records and the node-aware exchange against the flat one, from hand-made records."""
import pytest

from embrace_fairseq.perf.bench.markdown import _nodes
from embrace_fairseq.perf.bench.report import _run_record, node_exchange_check

LINK = {"gbit": 1.0, "latency_ms": 0.1}


def _rank(step_s, inter, wire):
    return {"step_s": step_s, "loss": [1.0] * len(step_s), "bytes_by_kind": {"rows": 10.0},
            "counted_bytes_by_op": {}, "wire_bytes_per_step": wire, "tokens": 10, "batch_steps": [0, 1, 2],
            "inter_node_bytes_by_kind": inter}


def _runs(flat_inter, node_inter, flat_steps, node_steps, model="lm"):
    flat = _run_record("embrace_schedule", [_rank(flat_steps, flat_inter, 400.0)] * 4, model, 4, LINK, None, 2)
    node = _run_record("embrace_node", [_rank(node_steps, node_inter, 300.0)] * 4, model, 4, LINK, None, 2)
    return [flat, node]


def test_per_node_accounting():
    flat, _ = _runs({"rows": 100.0, "dense_grad": 50.0}, {"rows": 60.0}, [1.0] * 3, [1.0] * 3)
    # two ranks per node: the node sends what both ranks send; both read the node's NIC
    assert flat["inter_node_bytes_per_node_per_step"] == {"dense_grad": 100.0, "rows": 200.0}
    assert flat["wire_bytes_per_node_per_step"] == 400.0 and flat["wire_bytes_per_rank_per_step"] == 200.0


def test_node_exchange_against_flat():
    runs = _runs({"rows": 100.0, "grad_rows": 100.0, "ids": 10.0, "dense_grad": 999.0},
                 {"rows": 60.0, "grad_rows": 60.0, "ids": 6.0, "dense_grad": 999.0},
                 [2.0, 2.2, 2.4], [1.0, 1.1, 1.2])
    c = node_exchange_check(runs)["lm/w4/1gbit_0.1ms"]
    # the exchange's kinds only (dense bytes are the same either way): 126 / 210
    assert c["bytes_node_over_flat"] == pytest.approx(0.6) and c["bytes_met"]
    assert c["flat_over_node_step"]["ratio"] == pytest.approx(2.0) and c["step_met"]
    text = "\n".join(_nodes({"runs": runs, "nodes": {"lm/w4/1gbit_0.1ms": c}}))
    assert "Between nodes (2 ranks per node)" in text and "= 0.60 (goal at most 0.7: met)" in text
    # more bytes, slower: both goals missed; the step goal is judged on the untied LM only
    miss = node_exchange_check(_runs({"rows": 100.0}, {"rows": 90.0}, [1.0] * 3, [1.0] * 3))
    assert miss["lm/w4/1gbit_0.1ms"]["bytes_met"] is False and miss["lm/w4/1gbit_0.1ms"]["step_met"] is False
    other = node_exchange_check(_runs({"rows": 100.0}, {"rows": 90.0}, [1.0] * 3, [1.0] * 3, model="translation"))
    assert "step_met" not in other["translation/w4/1gbit_0.1ms"]
    # one rank per node: nothing to compare
    assert node_exchange_check([dict(r, ranks_per_node=1) for r in runs]) == {}


def test_two_level_against_one_ring():
    from embrace_fairseq.perf.bench.report import two_level_check

    ring = _run_record("embrace_schedule", [_rank([1.5] * 3, {"dense_allreduce": 75.0}, 1.0)] * 4, "lm", 4, LINK, None, 2)
    two = _run_record("embrace_two_level", [_rank([1.0] * 3, {"dense_allreduce": 25.0}, 1.0)] * 4, "lm", 4, LINK, None, 2)
    c = two_level_check([ring, two])["lm/w4/1gbit_0.1ms"]
    assert (c["ring_dense_inter_node_bytes"], c["two_level_dense_inter_node_bytes"]) == (150.0, 50.0)
    assert c["ring_over_two_level_step"]["ratio"] == pytest.approx(1.5)
    text = "\n".join(_nodes({"runs": [ring, two], "two_level": {"lm/w4/1gbit_0.1ms": c}}))
    assert "two levels 0.00 MB / one ring 0.00 MB; one-ring step / two-level step 1.50x" in text
