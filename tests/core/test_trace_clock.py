"""One clock per trace (core/trace.py): every interval says the clock it was timed on, a
trace records its own, and a trace over two clocks has no hidden share. On CPU every
recorder times on the host; on a CUDA job the trace's clock is the device's, so its
compute phases, exchanges and collectives are all device intervals (the GPU half of this
is ``scripts/gpu_check.sh``'s ``one_clock`` check)."""
import json

import pytest
import torch

from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.trace import (HOST, EXCHANGE_TID, Clock, MixedClocksError, Tracer, TracingLedger,
                                        clock_for, clock_name, job_clock, record_overlapped, wait_point)
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule


class _DeviceTimes(Clock):
    """A clock named as a device's whose stamps are the host's: how a CUDA trace looks to
    the tracer's bookkeeping (its stamps are CUDA events there)."""

    name = "cuda:0"


def test_the_clock_of_a_device_and_of_a_cpu_job():
    assert clock_name("cpu") == clock_name(torch.device("cpu")) == HOST
    assert clock_name("cuda:1") == "cuda:1"
    assert clock_for("cpu").name == HOST
    if not torch.cuda.is_available():
        assert job_clock().name == HOST


def test_a_trace_records_its_clock_and_refuses_a_second_one(tmp_path):
    tr = Tracer(rank=1)
    with tr.phase("forward"):
        pass
    t0 = tr._t0
    tr.collective("dense_grad", 8, t0 + 1, t0 + 2)
    assert tr.summary()["clock"] == HOST and tr.clocks() == {"clock": HOST, "mixed": []}
    tr.collective("dense_grad", 8, t0 + 3, t0 + 4, clock="cuda:0")  # a device interval in a host trace
    assert tr.clocks()["mixed"] == ["dense_grad (cuda:0)"]
    with pytest.raises(MixedClocksError, match="timed on host but holds intervals timed on another clock"):
        tr.summary()
    saved = json.loads(open(tr.save(str(tmp_path / "t"))).read())  # the timeline is still written
    assert saved["otherData"]["clock"] == HOST and "error" in saved["otherData"]
    assert len([e for e in saved["traceEvents"] if e.get("cat") == "comm"]) == 2
    tr.clear()
    assert tr.summary()["clock"] == HOST  # a cleared trace starts over


def test_on_a_device_clock_phases_and_exchanges_follow_it_and_a_host_interval_is_refused():
    tr = Tracer(clock=_DeviceTimes())
    led = TracingLedger(tr, CommLedger())
    with tr.phase("backward"):
        led.mark()
        led.record("ids", 4, 4)  # a blocking exchange: timed on the trace's clock
    tr.instant("gradients_ready")
    s = tr.summary()
    assert s["clock"] == "cuda:0" and s["calls_by_kind"] == {"ids": 1}
    (ev,) = tr.events("comm")
    assert ev["tid"] == EXCHANGE_TID and ev["dur"] >= 0
    tr.compute("step", tr.now(), tr.now())  # a host interval: what the hidden share must not mix
    with pytest.raises(MixedClocksError, match=r"timed on cuda:0 .* step \(host\)"):
        tr.summary()


def test_an_overlapped_collective_is_split_on_its_own_clock():
    class Done:  # a finished CPU collective, as a Pending gives it
        device = torch.device("cpu")

        def __init__(self, issued, end):
            self.issued_us, self._end = issued, end

        def end_us(self):
            return self._end

    tr = Tracer()
    t0 = tr._t0
    waited = wait_point("cpu")
    assert isinstance(waited, float)  # the host's time on CPU (a CUDA event on a device)
    record_overlapped([TracingLedger(tr)], "hidden_gather", 64, 64, Done(t0 + 100, waited + 50), waited)
    assert [round(e["ts"] + e["dur"]) for e in tr.events("comm")][-1] == round(waited + 50 - t0)
    assert tr.clocks()["mixed"] == []


def test_the_scheduled_all_reduce_traces_on_the_host_clock_of_a_cpu_job(gloo1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    params = list(model.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
    opts = ScheduleOptions(piece_bytes=64, bucket_bytes=256, max_in_flight=2, compute_bytes_per_s=1e9,
                           link_bytes_per_s=1e9)
    tr = Tracer()
    red = ScheduledAllReduce(params, build_schedule(specs, opts), None, tracer=tr, trace_backward=True)
    with tr.phase("forward"):
        loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    red.finish()
    s = tr.summary()
    assert s["clock"] == HOST and tr.clocks()["mixed"] == []
    assert s["dense_collectives"] == len(red.schedule.issue_order)
    assert {e["name"] for e in tr.events("compute")} == {"forward", "backward"}
