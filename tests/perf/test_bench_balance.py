"""The bench report's exchange balance: busiest rank next to the mean, per phase."""
import pytest

from embrace_fairseq.perf.bench.report import exchange_balance


def _rank(rows_sent, rows_recv, grad_sent, grad_recv, secs=None):
    pr = {"bytes_by_kind": {"rows": rows_sent, "grad_rows": grad_sent, "ids": 1.0},
          "bytes_received_by_kind": {"rows": rows_recv, "grad_rows": grad_recv}}
    if secs is not None:
        pr["trace_summary"] = {"seconds_by_kind": {"rows": secs[0], "grad_rows": secs[1]}}
    return pr


def test_owner_side_max_over_mean_per_phase():
    # rank 0 owns the hot rows: serves 300 in forward, receives 300 gradient rows back
    ranks = [_rank(300, 100, 100, 300, (0.4, 0.8)), _rank(100, 300, 300, 100, (0.2, 0.4))]
    b = exchange_balance(ranks, steps=4)
    assert b["rows"]["owner_side"] == "sent" and b["grad_rows"]["owner_side"] == "received"
    for phase in ("rows", "grad_rows"):
        assert b[phase]["bytes_max"] == 300 and b[phase]["bytes_mean"] == 200
        assert b[phase]["bytes_max_over_mean"] == pytest.approx(1.5)
        assert b[phase]["link_max_over_mean"] == pytest.approx(1.5)
    assert b["rows"]["alltoall_s_max"] == pytest.approx(0.1) and b["rows"]["alltoall_s_mean"] == pytest.approx(0.075)
    assert b["grad_rows"]["alltoall_s_max_over_mean"] == pytest.approx(0.2 / 0.15)


def test_without_ledgers_or_traces():
    assert exchange_balance([{"bytes_by_kind": {"dense_allreduce": 5.0}}], steps=2) is None
    b = exchange_balance([_rank(10, 10, 10, 10), _rank(10, 10, 10, 10)], steps=2)
    assert b["rows"]["bytes_max_over_mean"] == 1.0 and "alltoall_s_max" not in b["rows"]
