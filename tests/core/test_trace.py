"""trace: the Tracer's summary for a known pattern of compute and collective intervals
(hidden share, dense collectives started in backward), the Chrome-trace JSON, and the
tracing ledger."""
import json

import pytest

from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.trace import COMM_TID, COMPUTE_TID, EXCHANGE_TID, TABLE_TID, Tracer, TracingLedger


def known_pattern(tracer):
    """Times in microseconds from the tracer's start.

    compute:  forward [0, 100), backward [100, 300), step [400, 450)
    dense all-reduces (COMM_TID): [150, 250) inside backward -> 100 hidden
                                  [280, 380) -> 20 hidden (backward ends at 300)
    table lane (TABLE_TID):       [200, 260) -> overlaps the first all-reduce, extends it by 10
    embedding exchange (EXCHANGE_TID), on the compute thread: [50, 80) -> exposed
    union of communication: [50, 80) + [150, 260) + [280, 380) = 30 + 110 + 100 = 240
    hidden (off the compute thread, inside compute): 110 + 20 = 130
    """
    t0 = tracer._t0
    tracer.compute("forward", t0 + 0, t0 + 100)
    tracer.compute("backward", t0 + 100, t0 + 300)
    tracer.compute("step", t0 + 400, t0 + 450)
    tracer.collective("dense_grad", 1000, t0 + 150, t0 + 250)
    tracer.collective("dense_grad", 3000, t0 + 280, t0 + 380)
    tracer.collective("table_grad", 500, t0 + 200, t0 + 260, tid=TABLE_TID)
    tracer.collective("rows", 64, t0 + 50, t0 + 80, tid=EXCHANGE_TID)


def test_summary_of_a_known_pattern():
    tr = Tracer(rank=3)
    known_pattern(tr)
    s = tr.summary()
    assert s["comm_seconds"] == pytest.approx(240e-6)
    assert s["hidden_seconds"] == pytest.approx(130e-6)
    assert s["hidden_share"] == pytest.approx(130 / 240)
    assert s["bytes_by_kind"] == {"dense_grad": 4000, "table_grad": 500, "rows": 64}
    assert s["calls_by_kind"] == {"dense_grad": 2, "table_grad": 1, "rows": 1}
    assert s["seconds_by_kind"]["dense_grad"] == pytest.approx(200e-6)
    assert s["dense_collectives"] == 2 and s["dense_started_in_backward"] == 2


def test_exchange_on_the_compute_thread_is_never_hidden():
    tr = Tracer()
    t0 = tr._t0
    tr.compute("forward", t0, t0 + 100)
    tr.collective("ids", 8, t0 + 10, t0 + 60, tid=EXCHANGE_TID)  # inside forward, yet exposed
    tr.collective("dense_grad", 8, t0 + 500, t0 + 600)  # after all compute
    s = tr.summary()
    assert s["hidden_share"] == 0.0 and s["comm_seconds"] == pytest.approx(150e-6)
    assert s["dense_started_in_backward"] == 0
    assert Tracer().summary()["hidden_share"] == 0.0  # nothing recorded: no division by zero


def test_chrome_trace_json(tmp_path):
    tr = Tracer(rank=2)
    known_pattern(tr)
    with tr.phase("extra", note="x"):
        pass
    path = tr.save(str(tmp_path / "sub" / "run"))
    assert path == str(tmp_path / "sub" / "run.rank2.json")
    doc = json.loads(open(path).read())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["name"] for e in meta} == {"rank 2", "compute", "dense all-reduce", "embedding exchange"}
    assert len(events) == 8
    for e in events:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} and e["pid"] == 2
        assert e["cat"] in ("compute", "comm") and e["dur"] >= 0
    fwd = next(e for e in events if e["name"] == "forward")
    assert (fwd["ts"], fwd["dur"], fwd["tid"]) == (0, 100, COMPUTE_TID)
    ar = [e for e in events if e["name"] == "dense_grad"]
    assert [(e["ts"], e["dur"], e["tid"], e["args"]["bytes"]) for e in ar] == [(150, 100, COMM_TID, 1000),
                                                                               (280, 100, COMM_TID, 3000)]
    assert next(e for e in events if e["name"] == "extra")["args"] == {"note": "x"}
    assert doc["otherData"]["dense_collectives"] == 2


def test_disabled_tracer_records_nothing():
    tr = Tracer(enabled=False)
    known_pattern(tr)
    with tr.phase("forward"):
        pass
    assert tr.events() == []


def test_tracing_ledger_turns_records_into_exchange_events():
    tr, inner = Tracer(), CommLedger()
    led = TracingLedger(tr, inner)
    led.mark()
    led.record("ids", 12, 8)
    led.record("rows", 48, 32)
    assert inner.sent == {"ids": 12, "rows": 48} and led.sent == {"ids": 12, "rows": 48}
    evs = tr.events("comm")
    assert [(e["name"], e["tid"], e["args"]["bytes"], e["args"]["received"]) for e in evs] == [
        ("ids", EXCHANGE_TID, 12, 8), ("rows", EXCHANGE_TID, 48, 32)]
    # the second exchange starts where the first ended
    assert evs[1]["ts"] == pytest.approx(evs[0]["ts"] + evs[0]["dur"])


def test_hidden_share_definition_by_hand():
    """comm = |union of all|, hidden = |overlappable ∩ compute|, exposed = comm - hidden."""
    from embrace_fairseq.core.trace import hidden_share

    got = hidden_share([(0, 10), (5, 15), (30, 40)], [(18, 20)], [(0, 8), (12, 35)])
    # union of comm: [0, 15) + [18, 20) + [30, 40) = 27; overlappable ∩ compute: 8 + 3 + 5 = 16
    assert got == pytest.approx({"comm": 27, "hidden": 16, "exposed": 11, "hidden_share": 16 / 27,
                                 "exposed_share": 11 / 27})
    assert hidden_share([], [], [(0, 1)])["hidden_share"] == 0.0


# default run: ~4 s (2 spawned gloo ranks, 1 s of sleeps)
def test_hidden_share_of_a_known_sleep_pattern():
    """Real gloo collectives whose durations the other rank sets by sleeping, a compute
    phase of known length, completion read late: the metric equals the hand-computed
    value (end times come from the collective's completion, not from the late read)."""
    import rank_fns_timing as T
    from embrace_fairseq.tools.local_ranks import run_ranks

    got = run_ranks(T.sleep_pattern, 2, timeout_s=120)[0]
    assert got["comm_seconds"] == pytest.approx(T.D1 + T.D2, abs=0.05), got
    assert got["hidden_seconds"] == pytest.approx(min(T.C, T.D1), abs=0.03), got
    assert got["hidden_share"] == pytest.approx(T.EXPECTED_SHARE, abs=0.05), got


def test_finished_async_collectives_are_not_kept(gloo1):
    """Tracing a long run must not keep every collective's buffers: a finished one is
    resolved (and released) when the next one is traced."""
    import gc
    import weakref

    import torch

    from embrace_fairseq.core import collectives

    tracer = Tracer(0)
    refs = []
    for _ in range(50):
        buf = torch.ones(1024)
        pending = collectives.all_reduce_async(buf)
        tracer.collective_async("dense_grad", buf.numel() * 4, pending)
        pending.wait()
        refs.append(weakref.ref(buf))
        del buf, pending
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 1, alive  # only the last one, still unresolved
    evs = tracer.events("comm")
    assert len(evs) == 50 and all(e["dur"] >= 0 for e in evs)


def test_take_and_extend_keep_settings_apart():
    """Events taken out for one setting and put back later give that setting's summary alone."""
    from embrace_fairseq.core.trace import Tracer

    t = Tracer()
    t.compute("backward", 0.0, 100.0)
    t.collective("dense_grad", 8, 10.0, 60.0)
    first = t.take()
    assert t.events() == [] and len(first) == 2
    t.collective("dense_grad", 4, 200.0, 300.0)  # another setting: exposed, never hidden
    second = t.take()
    t.extend(first)
    assert t.summary()["hidden_share"] == 1.0 and t.summary()["bytes_by_kind"] == {"dense_grad": 8}
    t.clear()
    t.extend(second)
    assert t.summary()["hidden_share"] == 0.0


class _Done:
    """A finished collective's times, as a Pending gives them."""

    def __init__(self, issued_us, end_us):
        self.issued_us, self._end = issued_us, end_us

    def end_us(self):
        return self._end


def test_overlapped_collective_is_split_at_the_wait():
    """Issued at 100, waited for from 130, finished at 170: 30 us hidden behind the
    caller's compute (the overlapped lane), 40 us exposed (the exchange lane); bytes once.
    Finished before the wait: all hidden. Waited for at once: all exposed."""
    from embrace_fairseq.core.trace import mark_start, record_overlapped

    tr, inner = Tracer(), CommLedger()
    led = TracingLedger(tr, inner)
    t0 = tr._t0
    record_overlapped([led], "hidden_gather", 64, 48, _Done(t0 + 100, t0 + 170), t0 + 130)
    record_overlapped([led], "hidden_grad", 32, 32, _Done(t0 + 200, t0 + 220), t0 + 250)
    record_overlapped([led], "softmax_stats", 8, 8, _Done(t0 + 300, t0 + 310), t0 + 290)
    evs = [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]["bytes"]) for e in tr.events("comm")]
    assert evs == [("hidden_gather", TABLE_TID, 100, 30, 64), ("hidden_gather", EXCHANGE_TID, 130, 40, 0),
                   ("hidden_grad", TABLE_TID, 200, 20, 32), ("softmax_stats", EXCHANGE_TID, 300, 10, 8)]
    assert inner.sent == {"hidden_gather": 64, "hidden_grad": 32, "softmax_stats": 8}
    assert led.sent == inner.sent
    # a blocking record after mark_start begins at the mark, not at the last record
    tr.clear()
    led._marks.t = t0 - 5e6  # the last record, 5 s of computation ago
    mark_start([led])
    led.record("ids", 4, 4)
    (ev,) = tr.events("comm")
    assert ev["dur"] < 1e6  # from the mark, not from the last record
    plain = CommLedger()
    record_overlapped([plain], "hidden_grad", 5, 6, _Done(0, 1), 0)
    assert plain.sent == {"hidden_grad": 5} and plain.received == {"hidden_grad": 6}
