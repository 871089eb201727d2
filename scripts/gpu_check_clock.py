"""The ``one_clock`` check of ``scripts/gpu_check.py``: one clock per trace on a GPU.

A traced backward phase whose device work waits behind a spin kernel of ~40 ms, with the
scheduled all-reduce (NCCL world of one, single-thread mode) tracing its pieces and the
backward it measures, three steps:

* the trace's clock is the device's (``cuda:0``) and :meth:`Tracer.summary` computes the
  hidden share (it refuses one over mixed clocks): the phase, the pieces and the
  executor's backward are all timed on the device;
* the phase is a device interval: it covers the delay, whatever the host's time in its
  body (recorded beside);
* the pieces start on the device after the delay: on the host's clock they would start
  inside the host's body, before the device ran the backward;
* an interval timed on another clock makes the summary refuse (``MixedClocksError``).

``--cpu-smoke``: the same on gloo, where the clock is the host's; the delay is GPU-only.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict

import torch

DELAY_MS = 40.0
STEPS = 3


def one_clock(out: Path, cpu: bool) -> Dict[str, Any]:
    import gpu_check_workers as W
    import torch.distributed as dist
    from gpu_check_device import _delay

    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.trace import HOST, COMM_TID, MixedClocksError, Tracer
    from embrace_fairseq.schedule.executor import ScheduledAllReduce
    from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

    device = W.init_world_of_one(cpu)
    d: Dict[str, Any] = {"backend": dist.get_backend()}
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)).to(device)
        params = list(model.parameters())
        specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
        opts = ScheduleOptions(piece_bytes=1 << 16, bucket_bytes=1 << 18, max_in_flight=2,
                               compute_bytes_per_s=1e9, link_bytes_per_s=1e9)
        tracer = Tracer()  # the job's clock: the device's once CUDA is in use
        red = ScheduledAllReduce(params, build_schedule(specs, opts), collectives.new_group(), tracer=tracer,
                                 trace_backward=True)
        d["single_thread"] = red.single_thread
        x = torch.randn(64, 256, device=device)
        host_ms = []
        for _ in range(STEPS):
            loss = model(x).square().sum()
            t = time.perf_counter()
            with tracer.phase("traced_backward"):
                _delay(device, DELAY_MS)  # the device is busy before the backward's kernels
                loss.backward()
            host_ms.append((time.perf_counter() - t) * 1e3)
            red.finish()
            for p in params:
                p.grad = None
        summary = tracer.summary()  # MixedClocksError if any interval is on another clock
        d["clock"] = summary["clock"]
        d["hidden_share"] = summary["hidden_share"]
        d["host_body_ms"] = host_ms
        phases = [e for e in tracer.events("compute") if e["name"] == "traced_backward"]
        pieces = [e for e in tracer.events("comm") if e["tid"] == COMM_TID]
        d["phase_ms"] = [e["dur"] / 1e3 for e in phases]
        # each step's first piece after its phase's start, in ms
        d["first_piece_after_phase_start_ms"] = [
            (min(e["ts"] for e in pieces if ph["ts"] <= e["ts"] <= ph["ts"] + ph["dur"] + 1e6) - ph["ts"]) / 1e3
            for ph in phases]
        ok = len(phases) == STEPS and bool(pieces)
        if cpu:
            ok = ok and d["clock"] == HOST
            d["gpu_only"] = "device intervals behind a spin kernel (CUDA events)"
        else:
            ok = (ok and d["clock"] == "cuda:0" and all(ms >= 0.8 * DELAY_MS for ms in d["phase_ms"])
                  and all(ms >= 0.8 * DELAY_MS for ms in d["first_piece_after_phase_start_ms"]))
        # an interval on another clock: the summary refuses
        tracer.compute("other_clock", 0.0, 1.0, clock="cuda:0" if cpu else HOST)
        try:
            tracer.summary()
            d["mixed_refused"] = False
        except MixedClocksError as exc:
            d["mixed_refused"] = str(exc)
        ok = ok and bool(d["mixed_refused"])
    finally:
        dist.destroy_process_group()
    return {"status": "pass" if ok else "fail", "detail": d}
