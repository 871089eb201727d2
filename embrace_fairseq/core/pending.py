"""An asynchronous collective in flight (:class:`Pending`): its result, its completion, its
times, and the lifetime of every tensor it reads or writes.

:class:`Pending` holds every tensor the collective uses until :meth:`Pending.wait` has
ordered the caller after it (on CUDA also recorded on the stream that waits for the
collective, so the caching allocator cannot hand the memory to another stream early):
ProcessGroupNCCL keeps them alive only until the first ``wait()``, and that wait may
order another stream. Completion and timing come from CUDA events on CUDA devices
(``work.wait()`` on NCCL only orders streams: it does not block the host) and from the
work's future on gloo. The launchers are in :mod:`~embrace_fairseq.core.collectives`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core.backends import group_label

Group = Optional["dist.ProcessGroup"]


def _now_us() -> float:
    return time.perf_counter() * 1e6

_WAIT_STREAMS: dict = {}
_CLOCK_ANCHORS: dict = {}  # device -> (event, host time when it completed, us)


def _clock_anchor(device: torch.device) -> Tuple[Any, float]:
    """An event on ``device`` and the host time it completed: the origin for turning a
    later event of the device into a time on :func:`time.perf_counter`'s clock. Taken
    once per device, on the first asynchronous collective, on a stream of its own: that
    stream is idle, so the one synchronisation returns at once. On the caller's stream it
    would wait for all the work queued there (a whole backward's kernels), stalling the
    host once and placing the first collective's issue after that work."""
    if device not in _CLOCK_ANCHORS:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.Stream(device=device))
        ev.synchronize()
        _CLOCK_ANCHORS[device] = (ev, _now_us())
    return _CLOCK_ANCHORS[device]


def event_us(event: Any, device: torch.device) -> float:
    """When a (completed, timing) CUDA ``event`` of ``device`` completed, on
    :func:`time.perf_counter`'s clock in microseconds (through the device's anchor)."""
    anchor, anchor_us = _clock_anchor(device)
    event.synchronize()
    return anchor_us + anchor.elapsed_time(event) * 1000.0


def record_event(device: torch.device) -> Any:
    """A timing CUDA event recorded now on ``device``'s current stream (the anchor is
    taken first, so that :func:`event_us` can place it)."""
    _clock_anchor(device)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


def _wait_stream(device: torch.device, group: Group) -> Any:
    """The stream that waits for ``group``'s collectives on ``device``: one per group, so
    an end event waits for its own collective (and the group's earlier ones, which
    complete first anyway), never for another group's."""
    key = (device, group_label(group))
    if key not in _WAIT_STREAMS:
        _WAIT_STREAMS[key] = torch.cuda.Stream(device=device)
    return _WAIT_STREAMS[key]


class Pending:
    """An asynchronous collective in flight.

    :meth:`wait` makes its result usable where the caller runs (gloo: blocks the host;
    NCCL: orders the current stream after it, as torch does) and returns it;
    :meth:`synchronize` blocks the host until the collective has *finished* (a CUDA
    event on CUDA devices), which is what a credit needs.

    Lifetimes: ``keep`` is every tensor the collective reads or writes (the launchers
    below pass them). They are held until :meth:`wait` has ordered the caller after the
    collective, on every backend; on CUDA they are also recorded on the group's wait
    stream (which waits for the collective), so memory a caller freed meanwhile is not
    reused by any stream before the collective is done.

    Times, on :func:`time.perf_counter`'s clock in microseconds, both from the same
    source: on CPU, :attr:`issued_us` is when it was issued and :meth:`end_us` when the
    work's future ran its completion callback; on CUDA both are device events on the
    group's wait stream -- a start event once the caller's stream reached the issue and
    the group's earlier collectives were done, an end event after the collective --
    placed on the host clock through a per-device anchor event (:func:`_clock_anchor`;
    the future's callbacks of NCCL work run when the work is enqueued, not finished).
    :attr:`host_issued_us` is the host's issue time on every device. On CPU the callback
    needs the interpreter lock: while other Python threads run it can be late by up to
    ``sys.getswitchinterval()`` (5 ms by default).
    """

    def __init__(self, launch: Callable[[], Any], device: torch.device,
                 finish: Optional[Callable[[], Any]] = None, keep: Sequence[torch.Tensor] = (),
                 group: Group = None) -> None:
        self.device = device
        self._finish = finish
        self._keep: Tuple[torch.Tensor, ...] = tuple(t for t in keep if torch.is_tensor(t))
        self._result: Any = None
        self._waited = False
        self._end: Optional[float] = None
        self._ended = threading.Event()
        self._cuda = device.type == "cuda"
        if self._cuda:
            _clock_anchor(device)
            self._start_ev = torch.cuda.Event(enable_timing=True)
            self._end_ev = torch.cuda.Event(enable_timing=True)
        self.host_issued_us = _now_us()
        self._work = launch()
        if self._cuda:
            stream = _wait_stream(device, group)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._start_ev.record(stream)
            with torch.cuda.stream(stream):
                self._work.wait()  # the wait stream waits for the collective's own stream
                self._end_ev.record(stream)
            for t in self._keep:
                if t.device.type == "cuda":
                    t.record_stream(stream)
        else:
            self._work.get_future().then(self._mark_end)

    @property
    def issued_us(self) -> float:
        """When the collective was issued: the host's time on CPU, the device start event
        on CUDA (waits for it)."""
        return event_us(self._start_ev, self.device) if self._cuda else self.host_issued_us

    def _mark_end(self, _fut: Any) -> None:
        self._end = _now_us()
        self._ended.set()

    def wait(self) -> Any:
        if not self._waited:
            self._work.wait()
            self._waited = True
            if self._finish is not None:
                self._result = self._finish()
            # the caller is ordered after the collective now: its tensors may go
            self._finish, self._keep = None, ()
            if not self._cuda:
                self._work = None  # gloo's work holds its tensors until it is destroyed
        return self._result

    def synchronize(self) -> None:
        """Block the host until the collective has finished."""
        if self._cuda:
            self._end_ev.synchronize()
        elif self._work is not None:
            self._work.wait()

    def done(self) -> bool:
        if self._cuda:
            return bool(self._end_ev.query())
        return self._work is None or bool(self._work.is_completed())

    def end_us(self) -> float:
        """When the collective completed (waits for it)."""
        self.synchronize()
        if self._cuda:
            return event_us(self._end_ev, self.device)
        # the future's callback runs at completion, at the latest right after the waiters wake
        if not self._ended.wait(timeout=60.0):
            raise RuntimeError("a completed collective's future never ran its completion callback")
        assert self._end is not None
        return self._end



class _FutureWork:
    """The work handle (for :class:`Pending`) of collectives run by a worker thread: its
    future is completed, or given the error, when they are done."""

    def __init__(self) -> None:
        self.future: Any = torch.futures.Future()

    def wait(self) -> bool:
        self.future.wait()  # raises the worker's error
        return True

    def is_completed(self) -> bool:
        return bool(self.future.done())

    def get_future(self) -> Any:
        return self.future
