"""2D communication schedule for the dense (replicated) gradients, computed once.

Two dimensions, each can be switched off:

* model level: a bucket's priority is the position, counted from the input, of the
  most input-near layer it holds. The next forward needs the input layers first, so
  when several pieces wait, the most urgent goes first. Off: plain readiness order
  (what DDP does).
* tensor level: a bucket bigger than ``piece_bytes`` is cut into pieces, so an urgent
  bucket that becomes ready later can overtake the rest of a big one. At most
  ``max_in_flight`` collectives are outstanding (credit), which is what lets an
  urgent piece overtake: it does not queue behind everything already issued. Off:
  whole buckets.

The issue order must be the same on every rank whatever its timing, or ranks pair up
different collectives (deadlock or silent corruption). Two ways keep it so:

* the live queue (the executor's communication thread): a priority queue over the
  pieces whose buckets are ready *on every rank*, agreed by a small all-reduce of
  readiness flags before each issue; ranked by :func:`piece_key`;
* the static list (issuing from the autograd thread, as NCCL needs): the same priority
  scheduler *simulated* once, on cost estimates from the parameter sizes, the readiness
  order and the rates in :class:`ScheduleOptions`; at run time the list is followed in
  order, each item waiting for its gradients.

Nothing here depends on torch or on any training framework.
"""
from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class TensorSpec:
    """What the schedule needs to know about one dense gradient.

    ``position`` is the tensor's distance from the input (0 = nearest): the model
    level priority. Registration order of module parameters follows the forward order
    in most models, so its index is the usual choice.
    """

    name: str
    numel: int
    element_size: int
    position: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Bucket:
    """Tensors reduced together as one flat buffer (indices into the spec list)."""

    index: int
    tensors: Tuple[int, ...]
    numel: int
    nbytes: int
    priority: int  # smaller = more urgent


@dataclass(frozen=True)
class Piece:
    """A slice ``[start, start + numel)`` of a bucket's flat buffer: one collective."""

    bucket: int
    index: int
    start: int
    numel: int
    nbytes: int


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a whole number of bytes") from None


@dataclass(frozen=True)
class ScheduleOptions:
    """Knobs of the schedule; the defaults suit a small model on CPU or one GPU node.

    The cost figures only shape the simulated order (relative speeds of backward
    compute and the link); they never gate anything at run time.
    """

    #: used for a rate that is neither set nor measured yet
    ASSUMED_COMPUTE_BYTES_PER_S: ClassVar[float] = 4e9
    ASSUMED_LINK_BYTES_PER_S: ClassVar[float] = 1e9

    model_level: bool = True
    tensor_level: bool = True
    #: defaults: ``EMBRACE_PIECE_BYTES`` / ``EMBRACE_BUCKET_BYTES`` where set (sizing a
    #: run whose engine has no flag for them, as fairseq's; a tiny test model's several
    #: buckets), else 1 MiB / 4 MiB
    piece_bytes: int = field(default_factory=lambda: _env_bytes("EMBRACE_PIECE_BYTES", 1 << 20))
    max_in_flight: int = 2
    bucket_bytes: int = field(default_factory=lambda: _env_bytes("EMBRACE_BUCKET_BYTES", 4 << 20))
    #: backward throughput in gradient bytes per second; None: measured (the executor
    #: re-simulates the list after the first reduced step), 4e9 until then
    compute_bytes_per_s: Optional[float] = None
    #: all-reduce throughput in payload bytes per second; None: measured at start-up
    link_bytes_per_s: Optional[float] = None
    latency_s: float = 50e-6  # per collective

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be a positive number of bytes, got {self.piece_bytes}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive number of bytes, got {self.bucket_bytes}")
        for name in ("compute_bytes_per_s", "link_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"{name} must be None (measured) or a positive number, got {v}")

    @property
    def compute_rate(self) -> float:
        return self.compute_bytes_per_s or self.ASSUMED_COMPUTE_BYTES_PER_S

    @property
    def link_rate(self) -> float:
        return self.link_bytes_per_s or self.ASSUMED_LINK_BYTES_PER_S


@dataclass
class Schedule:
    """The static plan: buckets, and the order in which every rank issues pieces."""

    tensors: List[TensorSpec]
    buckets: List[Bucket]
    issue_order: List[Piece]
    options: ScheduleOptions
    simulated: List[Tuple[float, float]] = field(default_factory=list)  # (start, end) per issued piece

    def pieces_of(self, bucket: int) -> List[Piece]:
        return [p for p in self.issue_order if p.bucket == bucket]

    def resimulate(self, compute_bytes_per_s: float, link_bytes_per_s: float) -> None:
        """Re-simulate the issue list, in place, with these rates (buckets and pieces are
        unchanged: they depend on sizes only). Same rates -> same list on every rank."""
        self.options = replace(self.options, compute_bytes_per_s=compute_bytes_per_s,
                               link_bytes_per_s=link_bytes_per_s)
        self.issue_order, self.simulated = _simulated_order(self.tensors, self.buckets, self.options)

    def describe(self) -> List[str]:
        """One line per issued piece, for logs and tests."""
        return [
            f"{i:3d} bucket {p.bucket} (prio {self.buckets[p.bucket].priority}) piece {p.index} "
            f"[{p.start}:{p.start + p.numel}] {p.nbytes} B"
            for i, p in enumerate(self.issue_order)
        ]


def readiness_order(tensors: Sequence[TensorSpec]) -> List[int]:
    """Static guess of the order gradients become ready: backward runs the layers in
    reverse, so the tensor farthest from the input is first (ties: reverse registration)."""
    return sorted(range(len(tensors)), key=lambda i: (-tensors[i].position, -i))


def make_buckets(tensors: Sequence[TensorSpec], ready: Sequence[int], bucket_bytes: int) -> List[Bucket]:
    """Consecutive tensors in readiness order, each bucket up to ``bucket_bytes``
    (a single larger tensor gets a bucket of its own), as DDP buckets."""
    buckets: List[Bucket] = []
    cur: List[int] = []
    cur_bytes = 0

    def close() -> None:
        nonlocal cur, cur_bytes
        if cur:
            buckets.append(
                Bucket(
                    index=len(buckets),
                    tensors=tuple(cur),
                    numel=sum(tensors[i].numel for i in cur),
                    nbytes=cur_bytes,
                    priority=min(tensors[i].position for i in cur),
                )
            )
        cur, cur_bytes = [], 0

    for i in ready:
        nb = tensors[i].nbytes
        if cur and cur_bytes + nb > bucket_bytes:
            close()
        cur.append(i)
        cur_bytes += nb
    close()
    return buckets


def cut_pieces(bucket: Bucket, piece_bytes: Optional[int]) -> List[Piece]:
    """Equal-ish pieces of at most ``piece_bytes`` (None: the whole bucket)."""
    if bucket.numel == 0:
        return []
    esize = max(1, bucket.nbytes // bucket.numel)
    if piece_bytes is None or bucket.nbytes <= piece_bytes:
        return [Piece(bucket.index, 0, 0, bucket.numel, bucket.nbytes)]
    n = math.ceil(bucket.nbytes / piece_bytes)
    base, extra = divmod(bucket.numel, n)
    out, start = [], 0
    for k in range(n):
        numel = base + (1 if k < extra else 0)
        out.append(Piece(bucket.index, k, start, numel, numel * esize))
        start += numel
    return out


def piece_key(buckets: Sequence[Bucket], piece: Piece, options: ScheduleOptions) -> tuple:
    """Which waiting piece goes first (smallest key): with the model level, the bucket
    holding the most input-near layer (the next forward needs it first), else readiness
    order (buckets are numbered in it); then the piece's place in its bucket. Used by the
    simulation here and by the executor's live queue, so both rank pieces alike.

    >>> b = [Bucket(0, (1,), 4, 16, priority=1), Bucket(1, (0,), 4, 16, priority=0)]
    >>> late_but_urgent, early = Piece(1, 0, 0, 4, 16), Piece(0, 0, 0, 4, 16)
    >>> piece_key(b, late_but_urgent, ScheduleOptions()) < piece_key(b, early, ScheduleOptions())
    True
    >>> piece_key(b, late_but_urgent, ScheduleOptions(model_level=False)) < piece_key(b, early, ScheduleOptions(model_level=False))
    False
    """
    if options.model_level:
        return (buckets[piece.bucket].priority, piece.bucket, piece.index)
    return (piece.bucket, piece.index)


def simulate(
    buckets: Sequence[Bucket],
    ready_time: Sequence[float],
    pieces: Sequence[Sequence[Piece]],
    options: ScheduleOptions,
) -> Tuple[List[Piece], List[Tuple[float, float]]]:
    """Priority scheduler with credit, on estimated times. Returns the issue list.

    One link, pieces use it one after the other; a piece holds a credit from its issue
    to its end. At each issue opportunity the waiting piece with the smallest key goes:
    (priority, readiness, piece) with the model level on, (readiness, piece) off.
    Deterministic: ties are broken by indices, never by anything measured.
    """
    order: List[Piece] = []
    spans: List[Tuple[float, float]] = []
    # arrival events: (time, bucket index)
    arrivals = sorted(range(len(buckets)), key=lambda b: (ready_time[b], b))
    waiting: List[Tuple[tuple, Piece]] = []
    in_flight: List[float] = []  # end times (min-heap)
    link_free = 0.0
    now = 0.0
    a = 0
    total = sum(len(p) for p in pieces)

    def key(p: Piece) -> tuple:
        return piece_key(buckets, p, options)

    while len(order) < total:
        # admit everything ready by now
        while a < len(arrivals) and ready_time[arrivals[a]] <= now:
            for p in pieces[arrivals[a]]:
                heapq.heappush(waiting, (key(p), p))
            a += 1
        # release credits that have ended
        while in_flight and in_flight[0] <= now:
            heapq.heappop(in_flight)
        if waiting and len(in_flight) < options.max_in_flight:
            _, p = heapq.heappop(waiting)
            start = max(now, link_free)
            end = start + options.latency_s + p.nbytes / options.link_rate
            link_free = end
            heapq.heappush(in_flight, end)
            order.append(p)
            spans.append((now, end))
            continue
        # advance to the next event: an arrival or a credit coming back
        candidates = []
        if a < len(arrivals):
            candidates.append(ready_time[arrivals[a]])
        if in_flight and (waiting or a < len(arrivals)):
            candidates.append(in_flight[0])
        if not candidates:  # pragma: no cover - total counts every piece
            break
        now = max(now, min(candidates))
    return order, spans


def build_schedule(tensors: Sequence[TensorSpec], options: ScheduleOptions = ScheduleOptions()) -> Schedule:
    """The static issue list for these dense gradients (same input -> same list on every rank)."""
    tensors = list(tensors)
    buckets = make_buckets(tensors, readiness_order(tensors), options.bucket_bytes)
    order, spans = _simulated_order(tensors, buckets, options)
    return Schedule(tensors=tensors, buckets=buckets, issue_order=order, options=options, simulated=spans)


def _simulated_order(tensors: Sequence[TensorSpec], buckets: Sequence[Bucket],
                     options: ScheduleOptions) -> Tuple[List[Piece], List[Tuple[float, float]]]:
    # estimated time each tensor's gradient is ready: backward cost ~ its size
    t, tensor_ready = 0.0, {}
    for i in readiness_order(tensors):
        t += tensors[i].nbytes / options.compute_rate
        tensor_ready[i] = t
    ready_time = [max(tensor_ready[i] for i in b.tensors) for b in buckets]
    piece_bytes = options.piece_bytes if options.tensor_level else None
    pieces = [cut_pieces(b, piece_bytes) for b in buckets]
    return simulate(buckets, ready_time, pieces, options)
