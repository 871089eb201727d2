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


def _run(strategy, step_s, rows_ratio):
    return {"model": "lm", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": strategy,
            "step_s": step_s, "median_step_s": sorted(step_s)[len(step_s) // 2],
            "exchange_balance": {"rows": {"bytes_max_over_mean": rows_ratio},
                                 "grad_rows": {"bytes_max_over_mean": rows_ratio}}}


def test_layout_check_compares_contiguous_with_strided_per_run():
    from embrace_fairseq.perf.bench.markdown import _layouts
    from embrace_fairseq.perf.bench.report import layout_check

    strided = [1.0, 1.2, 0.9, 1.1, 1.0, 1.3, 0.95, 1.05] * 3
    slower = [1.25 * s for s in strided]  # contiguous 25 % slower on every batch
    checks = layout_check([_run("embrace_contiguous", slower, 3.1), _run("embrace_schedule", strided, 1.07),
                           _run("deepspeed", slower, 1.0)])
    (key, c), = checks.items()
    assert key == "lm/w4/1gbit_0.1ms"
    assert c["contiguous_over_strided"]["ratio"] == pytest.approx(1.25)
    assert c["better"] and c["no_worse"]
    assert c["owner_bytes_max_over_mean"]["embrace_contiguous"]["rows"] == 3.1
    same = layout_check([_run("embrace_contiguous", strided[::-1], 3.1), _run("embrace_schedule", strided, 1.07)])
    assert not next(iter(same.values()))["better"]
    faster = layout_check([_run("embrace_contiguous", [0.7 * s for s in strided], 3.1),
                           _run("embrace_schedule", strided, 1.07)])
    assert not next(iter(faster.values()))["no_worse"]
    text = "\n".join(_layouts({"layouts": checks, "confidence": 0.95}))
    assert "1.250 [1.25, 1.25]" in text and "yes, faster" in text
    assert "NO" in "\n".join(_layouts({"layouts": faster}))
    assert layout_check([_run("embrace_schedule", strided, 1.0)]) == {}


def test_schedule_ablation_against_fifo_and_the_floor():
    from embrace_fairseq.perf.bench.markdown import _ablation
    from embrace_fairseq.perf.bench.report import schedule_ablation

    fifo = [1.0, 1.2, 1.1, 1.0]
    runs = [_run("compute_floor", [0.5] * 4, 1.0), _run("embrace_fifo", fifo, 1.0),
            _run("embrace_schedule", [s / 2 for s in fifo], 1.0), _run("fairseq_legacy_ddp", [3.0] * 4, 1.0)]
    runs[2]["hidden_share"] = 0.8
    rows = schedule_ablation(runs)["lm/w4/1gbit_0.1ms"]
    # only the ablation's variants, in its order; the floor and the stock strategies are not rows
    assert [r["strategy"] for r in rows] == ["embrace_fifo", "embrace_schedule"]
    base, sched = rows
    assert base["fifo_over_variant"]["ratio"] == 1.0
    # every step twice as fast: FIFO / variant is 2 whatever the resample
    assert sched["fifo_over_variant"]["ratio"] == pytest.approx(2.0)
    assert sched["fifo_over_variant"]["low"] == pytest.approx(2.0) == sched["fifo_over_variant"]["high"]
    assert sched["over_floor"] == pytest.approx(sched["median_step_s"] / 0.5)
    md = "\n".join(_ablation({"schedule_ablation": {"lm/w4/1gbit_0.1ms": rows}, "confidence": 0.95}))
    assert "| lm/w4/1gbit_0.1ms | (e) EmbRace, 2D schedule |" in md and "| 80% |" in md
    # without FIFO in the run there is nothing to compare with
    assert schedule_ablation([r for r in runs if r["strategy"] != "embrace_fifo"]) == {}
