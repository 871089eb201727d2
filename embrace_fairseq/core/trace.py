"""Chrome-trace timeline of compute phases and collectives, one file per rank.

Open ``<prefix>.rank<N>.json`` in https://ui.perfetto.dev or chrome://tracing.
Compute phases (forward, backward, optimizer step) are on one track, collectives on
another (kind, bytes, issue to completion). :meth:`Tracer.summary` reduces the timeline
to bytes by kind and the share of communication time hidden behind computation
(:func:`hidden_share`, defined there). Framework-agnostic: callers mark phases and
report collectives.

A collective's interval runs from its issue to its completion as the collective itself
reports it (:meth:`~embrace_fairseq.core.collectives.Pending.end_us`: the work's future
on CPU, a CUDA event on CUDA devices), not from when a thread next looks at it.

**One clock per trace** (:attr:`Tracer.clock`). On a CUDA job every interval is timed on
the device: a compute phase by CUDA events on the current stream around the phase's
code (when the device ran it, not when the host queued it), a collective by its own
events, a blocking exchange by events around it; on a CPU job every interval is a host
interval. The device's times are placed on :func:`time.perf_counter`'s scale through one
anchor per device (:func:`~embrace_fairseq.core.pending.event_us`), so both read in the
same unit. Each interval says the clock it was timed on; one timed on another clock than
the trace's is kept on the timeline but :meth:`Tracer.summary` refuses to compute a
hidden share over it (:class:`MixedClocksError`): a host interval beside device ones
measures when the host queued work, which on a GPU runs ahead of the device.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.pending import event_us, record_event

COMPUTE_TID = 0
COMM_TID = 1
EXCHANGE_TID = 2  # the embedding AlltoAlls, which run on the compute thread


def _now_us() -> float:
    return time.perf_counter() * 1e6


# --------------------------------------------------------------------------- clocks
#: the name of the host's clock (every CPU job's)
HOST = "host"


def clock_name(device: Any) -> str:
    """The clock that times work on ``device``: ``"host"``, or ``"cuda:<index>"``."""
    device = torch.device(device)
    if device.type != "cuda":
        return HOST
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


class Clock:
    """The host's clock: :func:`time.perf_counter` in microseconds. A *stamp* is a point
    on a clock (:meth:`stamp`), read in microseconds by :meth:`us`."""

    name = HOST

    def stamp(self) -> Any:
        return _now_us()

    def us(self, stamp: Any) -> float:
        return float(stamp)


class CudaClock(Clock):
    """A CUDA device's clock: a stamp is a timing event recorded on the current stream
    (the point the device reaches there), read through the device's anchor on
    :func:`time.perf_counter`'s scale (:func:`~embrace_fairseq.core.pending.event_us`:
    waits for the event). Times already read (numbers) pass through."""

    def __init__(self, device: Any) -> None:
        self.device = torch.device(device)
        self.name = clock_name(self.device)

    def stamp(self) -> Any:
        return record_event(self.device)

    def us(self, stamp: Any) -> float:
        return float(stamp) if isinstance(stamp, (int, float)) else event_us(stamp, self.device)


def clock_for(device: Any) -> Clock:
    """The clock that times work on ``device``."""
    return CudaClock(device) if torch.device(device).type == "cuda" else Clock()


def pending_clock(pending: Any) -> Clock:
    """The clock a collective in flight is timed on (a Pending's device's; one that names
    no device, the host's)."""
    return clock_for(getattr(pending, "device", "cpu"))


def job_clock() -> Clock:
    """The clock of this process's job: its current CUDA device's once CUDA is in use
    (the model is on the device before training starts), else the host's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return CudaClock(torch.device("cuda", torch.cuda.current_device()))
    return Clock()


class MixedClocksError(UserError, ValueError):
    """A trace holds intervals timed on different clocks (host and device)."""


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


Interval = Tuple[float, float]


def hidden_share(overlappable: List[Interval], blocking: List[Interval], compute: List[Interval]) -> Dict[str, float]:
    """The share of communication time hidden behind computation, on one rank.

    Let ``C`` be the union of every communication interval (issue to completion) --
    ``overlappable`` ones (issued asynchronously: dense all-reduce pieces, table
    collectives) and ``blocking`` ones (run on the compute thread itself: the embedding
    exchanges, during which that thread computes nothing) -- ``A`` the union of the
    overlappable ones, and ``B`` the union of the compute intervals (forward, backward,
    step). Then::

        comm    = |C|               communication time, concurrent collectives counted once
        hidden  = |A ∩ B|           communication time during which compute ran
        exposed = comm - hidden     communication time not overlapped with compute
        hidden_share  = hidden / comm   (0 when there is no communication)
        exposed_share = exposed / comm = 1 - hidden_share

    A blocking exchange is never hidden even though it lies inside a compute phase.
    Times in the unit of the intervals; pure.
    """
    comm = _union(list(overlappable) + list(blocking))
    total = sum(e - s for s, e in comm)
    hidden = _overlap(_union(list(overlappable)), _union(list(compute)))
    share = hidden / total if total > 0 else 0.0
    return {"comm": total, "hidden": hidden, "exposed": total - hidden, "hidden_share": share,
            "exposed_share": (1.0 - share) if total > 0 else 0.0}


class Tracer:
    """Collects events in memory; thread-safe. Disabled tracers cost one branch.

    ``clock``: the trace's one clock (module doc); by default :func:`job_clock`, taken at
    the first use (after the model is on its device)."""

    def __init__(self, rank: int = 0, enabled: bool = True, clock: Optional[Clock] = None) -> None:
        self.rank = rank
        self.enabled = enabled
        self._clock = clock
        self._events: List[Dict[str, Any]] = []
        self._unresolved: List[Any] = []
        self._mixed: List[str] = []  # intervals timed on another clock than the trace's
        self._lock = threading.Lock()
        self._t0 = _now_us()

    # ------------------------------------------------------------------ recording
    @property
    def clock(self) -> Clock:
        if self._clock is None:
            self._clock = job_clock()
        return self._clock

    def now(self) -> float:
        """The host's time in microseconds (for arguments of events, not their times)."""
        return _now_us()

    def stamp(self) -> Any:
        """A point on the trace's clock (a number on the host, a CUDA event on a device)."""
        return self.clock.stamp()

    @contextlib.contextmanager
    def phase(self, name: str, **args: Any) -> Iterator[None]:
        """A compute phase (forward, backward, step) around the ``with`` body, on the
        trace's clock."""
        if not self.enabled:
            yield
            return
        start = self.stamp()
        try:
            yield
        finally:
            self._add(name, "compute", start, self.stamp(), COMPUTE_TID, args, self.clock.name)

    def compute(self, name: str, start_us: Any, end_us: Any, clock: str = HOST, **args: Any) -> None:
        """A compute interval timed on ``clock`` (microseconds, or stamps of that clock)."""
        if self.enabled:
            self._add(name, "compute", start_us, end_us, COMPUTE_TID, args, clock)

    def instant(self, name: str, **args: Any) -> None:
        """A point in time on the compute track, on the trace's clock (category ``mark``:
        no interval, it takes no part in the hidden share)."""
        if self.enabled:
            ev = {"name": name, "cat": "mark", "ph": "i", "s": "t", "ts": self.stamp(),
                  "pid": self.rank, "tid": COMPUTE_TID, "args": args, "_clock": self.clock.name}
            with self._lock:
                self._events.append(ev)

    def collective(self, kind: str, nbytes: int, start_us: Any, end_us: Any, tid: int = COMM_TID,
                   clock: str = HOST, **args: Any) -> None:
        """One collective, from issue to completion, timed on ``clock`` (microseconds, or
        stamps of that clock)."""
        if self.enabled:
            self._add(kind, "comm", start_us, end_us, tid, dict(args, kind=kind, bytes=int(nbytes)), clock)

    def collective_async(self, kind: str, nbytes: int, pending: Any, tid: int = COMM_TID, **args: Any) -> None:
        """A collective still in flight: its times are read (``pending.issued_us``,
        ``pending.end_us()``) once it has finished. The collectives that finished since
        the last call are resolved here, so the tracer never keeps a finished one (and
        the buffers it holds: a gathered table, a gradient bucket) beyond the next call."""
        if self.enabled:
            self._resolve(finished_only=True)
            with self._lock:
                self._unresolved.append((kind, nbytes, pending, tid, args))

    def _resolve(self, finished_only: bool = False) -> None:
        with self._lock:
            if finished_only:
                todo, keep = [], []
                for u in self._unresolved:  # one done() per entry: it may turn true meanwhile
                    (todo if u[2].done() else keep).append(u)
                self._unresolved = keep
            else:
                todo, self._unresolved = self._unresolved, []
        for kind, nbytes, pending, tid, args in todo:
            self.collective(kind, nbytes, pending.issued_us, pending.end_us(), tid=tid,
                            clock=pending_clock(pending).name, **args)

    def _add(self, name: str, cat: str, start: Any, end: Any, tid: int, args: Dict[str, Any], clock: str) -> None:
        """An interval timed on ``clock``; its stamps are read when the trace is read."""
        ev = {"name": name, "cat": cat, "ph": "X", "ts": start, "dur": end, "pid": self.rank, "tid": tid,
              "args": args, "_clock": clock}
        with self._lock:
            if clock != self.clock.name:
                self._mixed.append(f"{name} ({clock})")
            self._events.append(ev)

    def _read_stamps(self) -> None:
        """Every event's stamps in microseconds from the trace's origin (a CUDA stamp
        waits for its event)."""
        with self._lock:
            todo = [e for e in self._events if "_clock" in e]
        for e in todo:
            clk = self.clock if e["_clock"] == self.clock.name else _clock_named(e["_clock"])
            start = clk.us(e["ts"])
            if e["ph"] == "X":
                e["dur"] = max(0.0, clk.us(e["dur"]) - start)
            e["ts"] = start - self._t0
            del e["_clock"]

    # ------------------------------------------------------------------ reading
    def events(self, cat: Optional[str] = None) -> List[Dict[str, Any]]:
        self._resolve()
        self._read_stamps()
        with self._lock:
            evs = list(self._events)
        return [e for e in evs if cat is None or e["cat"] == cat]

    def clocks(self) -> Dict[str, Any]:
        """The trace's clock and the intervals timed on another one (none: one clock)."""
        self._resolve()
        with self._lock:
            return {"clock": self.clock.name, "mixed": list(self._mixed)}

    def check_one_clock(self) -> None:
        """Raise :class:`MixedClocksError` unless every interval is on the trace's clock."""
        c = self.clocks()
        if c["mixed"]:
            shown = ", ".join(c["mixed"][:5]) + (", ..." if len(c["mixed"]) > 5 else "")
            raise MixedClocksError(
                f"the trace of rank {self.rank} is timed on {c['clock']} but holds intervals timed on another "
                f"clock: {shown}; a hidden share over them would compare host and device times")

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._unresolved.clear()
            self._mixed.clear()

    def take(self) -> List[Dict[str, Any]]:
        """Every event so far, removed from the tracer (a caller that interleaves several
        settings keeps each setting's events apart and puts them back with :meth:`extend`)."""
        evs = self.events()
        self.clear()
        return evs

    def extend(self, events: List[Dict[str, Any]]) -> None:
        """Add events taken earlier (same tracer: their times share its origin)."""
        with self._lock:
            self._events.extend(events)

    def summary(self) -> Dict[str, Any]:
        """Bytes and time by kind, and how much communication time overlapped compute.

        ``hidden_share`` / ``exposed_share`` / ``comm_seconds`` / ``hidden_seconds`` /
        ``exposed_seconds``: :func:`hidden_share` over the whole trace; the embedding
        exchanges run on the compute thread, so they count as exposed.
        ``dense_started_in_backward``: dense collectives issued before their backward ended.
        ``clock``: the trace's one clock; a trace over several raises
        :class:`MixedClocksError` instead (:meth:`check_one_clock`).
        """
        self.check_one_clock()
        comm = self.events("comm")
        compute = self.events("compute")
        by_kind_bytes: Dict[str, int] = defaultdict(int)
        by_kind_time: Dict[str, float] = defaultdict(float)
        by_kind_calls: Dict[str, int] = defaultdict(int)
        for e in comm:
            k = e["args"]["kind"]
            by_kind_bytes[k] += e["args"]["bytes"]
            by_kind_time[k] += e["dur"] / 1e6
            by_kind_calls[k] += 1
        # hide behind compute only on other threads: the exchange blocks compute itself
        share = hidden_share([(e["ts"], e["ts"] + e["dur"]) for e in comm if e["tid"] != EXCHANGE_TID],
                             [(e["ts"], e["ts"] + e["dur"]) for e in comm if e["tid"] == EXCHANGE_TID],
                             [(e["ts"], e["ts"] + e["dur"]) for e in compute])
        backward = [(e["ts"], e["ts"] + e["dur"]) for e in compute if e["name"] == "backward"]
        started_in_bwd = 0
        for e in comm:
            if e["tid"] == COMM_TID and any(s <= e["ts"] < end for s, end in backward):
                started_in_bwd += 1
        return {
            "bytes_by_kind": dict(by_kind_bytes),
            "seconds_by_kind": dict(by_kind_time),
            "calls_by_kind": dict(by_kind_calls),
            "comm_seconds": share["comm"] / 1e6,
            "hidden_seconds": share["hidden"] / 1e6,
            "exposed_seconds": share["exposed"] / 1e6,
            "hidden_share": share["hidden_share"],
            "exposed_share": share["exposed_share"],
            "dense_collectives": sum(1 for e in comm if e["tid"] == COMM_TID),
            "dense_started_in_backward": started_in_bwd,
            "clock": self.clock.name,
        }

    def save(self, prefix: str) -> str:
        """Write ``<prefix>.rank<N>.json`` (Chrome trace format) and return its path."""
        path = f"{prefix}.rank{self.rank}.json"
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": COMM_TID, "args": {"name": "dense all-reduce"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": EXCHANGE_TID, "args": {"name": "embedding exchange"}},
        ]
        try:
            other: Dict[str, Any] = self.summary()
        except MixedClocksError as exc:  # the timeline is still worth reading
            other = dict(self.clocks(), error=str(exc))
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events(), "displayTimeUnit": "ms", "otherData": other}, f)
        return path


def _clock_named(name: str) -> Clock:
    return Clock() if name == HOST else CudaClock(name)


class TracingLedger(CommLedger):
    """A ledger that also turns each recorded collective into a trace event.

    The exchange primitives record a collective right after it returns, so the record
    time is its end. Its start is the previous mark on the same thread: the last
    record, or a :meth:`mark` the caller sets where an exchange begins (module forward
    pre-hook, gradient arrival in backward). An inner ledger keeps receiving records.
    """

    def __init__(self, tracer: Tracer, inner: Optional[CommLedger] = None) -> None:
        super().__init__()
        self.tracer = tracer
        self.inner = inner
        self._marks = threading.local()

    def mark(self) -> None:
        if self.tracer.enabled:
            self._marks.t = self.tracer.stamp()

    def record(self, kind: str, sent: int, received: int, inter_node: Optional[int] = None) -> None:
        super().record(kind, sent, received, inter_node)
        if self.inner is not None:
            self.inner.record(kind, sent, received, inter_node)
        if not self.tracer.enabled:
            return
        # on the trace's clock: on CUDA events on the current stream, which the blocking
        # exchange's collectives were ordered before
        end = self.tracer.stamp()
        start = getattr(self._marks, "t", end)
        self.tracer.collective(kind, sent, start, end, tid=EXCHANGE_TID, clock=self.tracer.clock.name,
                               received=int(received))
        self._marks.t = end


#: trace lane of the overlapped table collectives (apart from the dense all-reduce's)
TABLE_TID = 3


def _count_bytes(ledger: CommLedger, kind: str, sent: int, received: int) -> bool:
    """Record a collective's bytes without a trace event; True when ``ledger`` traces (the
    caller then adds the event itself)."""
    if not isinstance(ledger, TracingLedger):
        ledger.record(kind, sent, received)
        return False
    CommLedger.record(ledger, kind, sent, received)
    if ledger.inner is not None:
        ledger.inner.record(kind, sent, received)
    return True


def record_async(ledgers: List[CommLedger], kind: str, sent: int, received: int, pending: Any) -> None:
    """Count the bytes now; a tracing ledger also gets the collective as an event from
    its issue to its completion, taken from ``pending`` (a
    :class:`~embrace_fairseq.core.collectives.Pending`: the work's future on gloo, CUDA
    events on CUDA devices), not from whoever waits for it."""
    for ledger in ledgers:
        if not _count_bytes(ledger, kind, sent, received):
            continue
        if ledger.tracer.enabled:
            ledger.tracer.collective_async(kind, sent, pending, tid=TABLE_TID, received=int(received))


def mark_start(ledgers: List[CommLedger]) -> None:
    """A blocking collective begins now: a tracing ledger's next record on this thread
    starts here (not at the previous record, which may be computation ago)."""
    for ledger in ledgers:
        if isinstance(ledger, TracingLedger):
            ledger.mark()


def wait_point(device: Any) -> Any:
    """Where the caller starts waiting for a collective on ``device``, on that device's
    clock (:func:`clock_for`): the host's time on CPU, an event on the current stream on
    CUDA (where the stream starts waiting). For :func:`record_overlapped`."""
    return clock_for(device).stamp()


def record_overlapped(ledgers: List[CommLedger], kind: str, sent: int, received: int, pending: Any,
                      waited_us: Any) -> None:
    """Count the bytes of an asynchronous collective the caller computed beside and then
    waited for, from ``waited_us`` (:func:`wait_point`, taken before the wait; call this
    after it). A tracing ledger gets the collective's time split there: issue to then on
    the overlapped lane (hidden behind the caller's compute), then to completion on the
    exchange lane (the compute thread waited: exposed). The bytes go with the first part;
    a part of no length is left out. All three times are on the collective's device's
    clock."""
    for ledger in ledgers:
        if not _count_bytes(ledger, kind, sent, received):
            continue
        if ledger.tracer.enabled:
            clock = pending_clock(pending)
            start, end = pending.issued_us, pending.end_us()
            split = min(max(clock.us(waited_us), start), end)
            rest = sent
            if split > start:
                ledger.tracer.collective(kind, sent, start, split, tid=TABLE_TID, clock=clock.name,
                                         received=int(received))
                rest = 0
            if end > split or rest:
                ledger.tracer.collective(kind, rest, split, end, tid=EXCHANGE_TID, clock=clock.name,
                                         received=int(received) if rest else 0)
        ledger.mark()
