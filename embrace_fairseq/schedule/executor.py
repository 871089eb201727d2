"""Executes the dense gradients' 2D :class:`~embrace_fairseq.schedule.plan.Schedule` during backward.

Each dense parameter gets a post-accumulate-grad hook that marks its gradient ready.
A communication thread walks the schedule's static list in order: it waits until the
item's bucket is complete, waits for a credit, and issues the piece as an asynchronous
all-reduce; because the order is the list's, every rank pairs the same collectives
whatever its timing.

With ``live_queue`` the thread runs a priority queue instead: before each issue the ranks agree,
with a small all-reduce (MIN) of per-bucket readiness flags on a group of its own,
which buckets are ready everywhere; their pieces enter the queue and the most urgent
waiting piece (:func:`~embrace_fairseq.schedule.plan.piece_key`) goes out as an
asynchronous all-reduce once a credit is free. A ready piece therefore never waits for
an earlier one that is not ready, and every rank still pairs the same collectives
whatever its timing: what is issued depends only on what all ranks agreed. After a round
every free credit is used; a rank with nothing queued and nothing new waits for its next
ready bucket before agreeing again, so there is at most one agreement round per credit
that comes back and one per bucket. (Agreement is
needed because which parameters get a gradient, and so the order buckets complete in,
can differ between ranks: fairseq's adaptive softmax computes a tail cluster only when
a target falls in it.) Each round needs every rank's communication thread scheduled; on
ranks that oversubscribe their cores that latency delays the pieces (FIFO overlap hid
40 % of its communication with the live queue on 4 ranks sharing 2 cores, 76 % in an
earlier run with the static list), so the static list stays the default.

The all-reduces run on a process group of their own: the embedding AlltoAlls of the
autograd thread use the default group, and two threads sharing one group would
interleave their collectives in timing-dependent order.

Where the order *across* groups matters too -- NCCL, whose kernels of different
communicators can wait on each other on the device -- there is no thread: the pieces are
issued from the autograd thread itself, inside the gradient hooks, following the
schedule's static list (an agreement round there would stall the autograd thread on a
host-side collective), as soon as the list's next piece is ready (and the exchange gate
open). The hooks fire in the graph's
order, the same on every rank, so every rank issues every collective (dense pieces and
embedding exchanges alike) in one order. Credits wait for the oldest piece in flight to
*finish* (a CUDA event there; ``work.wait()`` on NCCL does not block the host), and
trace times come from the same events (from the work's future on gloo). No lock is
held across a collective.

Average convention: the sum over ranks divided by the world size (what DDP and stock
DeepSpeed leave in ``.grad``). Framework-agnostic: the caller says when a backward
is the one to reduce (``active``) and calls :meth:`finish` before the optimizer step.
"""
from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from typing import Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core.ring_volume import ring_allreduce_bytes_int
from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ledger import CommLedger, global_ledger
from embrace_fairseq.core.node_topology import NodeGroups, NodeTopology, node_groups
from embrace_fairseq.schedule import rates
from embrace_fairseq.schedule.plan import Schedule, piece_key
from embrace_fairseq.core.trace import Tracer

logger = logging.getLogger(__name__)


class ExchangeGate:
    """The embedding exchange as the first item of the schedule: while a table's gradient
    exchange is in flight, no new dense piece is issued, so the exchange the next
    forward needs first does not queue behind them. Pieces already issued complete; the
    per-group issue order is unchanged.

    Exactly one :meth:`enter` and one :meth:`leave` per exchange: use :meth:`exchange`
    around the exchange itself (a table's gradient-exchange scope, see
    ``ShardedEmbedding.set_grad_exchange_scope``), not around what it serves -- a table
    read by encoder and decoder has two looked-up outputs and one shard gradient, and
    pairing enters with either would leave the gate closed for the rest of backward.
    :attr:`entered` and :attr:`left` count both, for checks.

    The gate's lock guards only its counters and is never held across a collective: a
    piece being issued holds an *issue slot* (a counter), and an exchange that starts
    meanwhile waits on the condition until the (asynchronous) issue returned."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._issuing = 0
        self._listeners: List[Callable[[], None]] = []
        self.entered = 0  # exchanges begun, ever
        self.left = 0  # exchanges ended, ever

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy > 0

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (outside the lock) each time the gate opens."""
        self._listeners.append(fn)

    def enter(self) -> None:
        with self._cond:
            while self._issuing:
                self._cond.wait()
            self._busy += 1
            self.entered += 1

    def leave(self) -> None:
        with self._cond:
            if self._busy == 0:
                raise RuntimeError("ExchangeGate.leave() without a matching enter()")
            self._busy -= 1
            self.left += 1
            opened = self._busy == 0
            self._cond.notify_all()
        if opened:
            self._opened()

    @contextlib.contextmanager
    def exchange(self):
        """One exchange: closed (entered) for the body, left after it, also on an error."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def _opened(self) -> None:
        for fn in list(self._listeners):
            fn()

    def wait_idle(self) -> None:
        """Block until no exchange is in flight (the lock is released on return)."""
        with self._cond:
            while self._busy:
                self._cond.wait()

    @contextlib.contextmanager
    def idle(self):
        """Wait until no exchange is in flight, then run the body (the issue of a piece)
        in an issue slot: the lock is released, an exchange starting meanwhile waits for
        the body to return."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._issuing += 1
        try:
            yield
        finally:
            with self._cond:
                self._issuing -= 1
                self._cond.notify_all()


def gate_scope(gate: Optional[ExchangeGate], active: Callable[[], bool],
               mark: Optional[Callable[[], None]] = None) -> Callable[[], ContextManager[None]]:
    """The scope of one table's gradient exchange, for
    ``ShardedEmbedding.set_grad_exchange_scope``: in a reducing backward (``active()``)
    the gate is closed for the exchange (entered when it begins, left when it ended);
    ``mark`` (a trace mark) runs when it starts, either way."""

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        if gate is None or not active():
            if mark is not None:
                mark()
            yield
            return
        with gate.exchange():
            if mark is not None:
                mark()
            yield

    return scope


class ScheduledAllReduce:
    """Scheduled, overlapped all-reduce of replicated gradients.

    Args:
        params: the dense parameters, in the order the schedule's specs were built from.
        schedule: the static plan (same on every rank).
        group: process group for the all-reduces (give it one of its own, see module doc).
        overlap: issue during backward; off issues the same list in :meth:`finish`,
            after backward, where stock data parallel engines reduce.
        active: says whether the running backward is one whose gradients get reduced
            (gradient accumulation reduces only at the boundary).
        ledger, tracer: byte accounting and timeline (optional).
        gate: an :class:`ExchangeGate`: no piece is issued while an embedding exchange is in flight.
        single_thread: issue from the autograd thread (no communication thread), in the
            static list's order. ``None`` (default): where the group's backend needs one
            issue order across groups (NCCL).
        live_queue: the communication thread runs the live priority queue over the
            buckets ready on every rank instead of following the static list (not in
            single-thread mode).
        agree_group: the group of the live queue's readiness agreement (same ranks as
            ``group``). ``None``: one is created now (collective: every rank builds its
            reducer in the same order).
        trace_backward: put a ``backward`` compute phase on the trace, from the first
            gradient hook to the end of backward (for engines whose backward the caller
            cannot time itself, as fairseq's trainer).
        topology: the job's nodes (``group`` spanning the whole job). On several nodes of
            several ranks, a gloo group's pieces on CPU are all-reduced in two levels
            (:func:`~embrace_fairseq.core.collectives.all_reduce_two_level`; gloo's ring
            knows no nodes), on node and rail groups of their own (collective: created
            now). Also says which of the ledger's dense bytes leave the node.
        two_level: use the two-level all-reduce where it applies (default False: one
            ring over all ranks, which measured faster on the emulated 2 x 2 cluster).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        schedule: Schedule,
        group: Optional["dist.ProcessGroup"],
        *,
        overlap: bool = True,
        active: Callable[[], bool] = lambda: True,
        ledger: Optional[CommLedger] = None,
        tracer: Optional[Tracer] = None,
        gate: Optional[ExchangeGate] = None,
        single_thread: Optional[bool] = None,
        agree_group: Optional["dist.ProcessGroup"] = None,
        trace_backward: bool = False,
        live_queue: bool = False,
        topology: Optional[NodeTopology] = None,
        two_level: bool = False,
    ) -> None:
        if len(params) != len(schedule.tensors):
            raise ValueError(f"schedule was built for {len(schedule.tensors)} tensors, got {len(params)} parameters")
        self.params = list(params)
        self.schedule = schedule
        self.group = group
        self.world_size = collectives.world_size(group)
        if single_thread is None:
            single_thread = collectives.is_distributed() and collectives.issues_from_one_thread(group)
        self.single_thread = bool(single_thread)
        self.overlap = overlap
        self.active = active
        self.ledgers = [global_ledger()] + ([ledger] if ledger is not None and ledger is not global_ledger() else [])
        self.tracer = tracer or Tracer(enabled=False)
        self.trace_backward = trace_backward
        self.gate = gate
        if gate is not None and self.single_thread:
            gate.add_listener(self._gate_opened)
        self._bucket_of = {}
        for b in schedule.buckets:
            for t in b.tensors:
                self._bucket_of[t] = b.index
        self._flat: List[Optional[torch.Tensor]] = [None] * len(schedule.buckets)
        self._lock = threading.Lock()  # guards readiness only; never held across a collective
        self._changed = threading.Condition(self._lock)  # a bucket became ready
        self.live_queue = bool(live_queue) and not self.single_thread
        self.agree_group = agree_group
        if agree_group is None and self.live_queue and self.world_size > 1:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.agree_group = collectives.new_group(ranks)
        self.topology = topology
        self.two_level: Optional[NodeGroups] = None
        if (two_level and topology is not None and topology.world_size == self.world_size == collectives.world_size()
                and not self.single_thread and collectives.backend_name(group) == "gloo"):
            self.two_level = node_groups(topology, purpose="dense")  # collective; None on one node
        #: agreement rounds of the last reduced step (live queue), for logs and tests
        self.agreement_rounds = 0
        # rates not set in the options are measured: the link now, backward at the
        # first reduced step, after which the static list is re-simulated
        opts = schedule.options
        self._measure_backward = opts.compute_bytes_per_s is None
        self._link_rate = opts.link_bytes_per_s
        if self._link_rate is None:
            self._link_rate = rates.measure_link_bytes_per_s(opts.piece_bytes, group)
        if not self._measure_backward and opts.link_bytes_per_s is None:
            schedule.resimulate(opts.compute_bytes_per_s, self._link_rate)
        #: (backward, link) bytes per second the static list was last simulated with
        self.rates = (schedule.options.compute_rate, self._link_rate)
        # seconds from the first gradient hook to the end of the last reduced backward on
        # this rank (None: no hook fired); False until a reduced step has run
        self._last_backward_s: object = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._reset()

    # ------------------------------------------------------------------ per step state
    def _reset(self) -> None:
        self._started = False
        self._backward_s: Optional[float] = None  # this step's, from the first hook (None: none fired)
        self._ready = [False] * len(self.params)
        self._missing = [len(b.tensors) for b in self.schedule.buckets]
        self._events = [threading.Event() for _ in self.schedule.buckets]
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._next = 0  # single-thread mode: index of the next piece of the issue list
        self._inflight: List[tuple] = []  # (pending, piece), oldest first
        self._flattened: set = set()
        # the gradient each parameter had when it was marked ready: flattened from here,
        # so that a deferred step (:meth:`defer`) may clear ``.grad`` meanwhile
        self._grads: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._issued: dict = {}  # (bucket, piece index) -> Pending, for :meth:`wait_bucket`
        self._issued_cond = threading.Condition()
        self._deferred = False
        self._averaged: set = set()  # buckets whose average is in .grad (deferred step)

    def remove(self) -> None:
        """Detach the hooks (the object is unusable afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ readiness
    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.active():
                return
            if not self._started:
                self._begin()
                # runs once the whole backward is done: covers parameters without a gradient
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._mark(i)
            if self.single_thread and self.overlap:
                self._issue_ready()

        return hook

    def _begin(self) -> None:
        if self._deferred:
            raise RuntimeError("a reducing backward began while the previous step's deferred all-reduce was not "
                               "drained: complete its buckets (NextForwardUpdates.flush) before the next backward")
        self._started = True
        self._backward_t0_s = time.perf_counter()
        self._backward_t0_us = self.tracer.now()
        if self.overlap and not self.single_thread:
            self._start_thread()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="embrace-allreduce", daemon=True)
            self._thread.start()

    def _mark(self, i: int) -> None:
        with self._lock:
            if self._ready[i]:
                return
            self._ready[i] = True
            self._grads[i] = self.params[i].grad
            b = self._bucket_of[i]
            self._missing[b] -= 1
            if self._missing[b] == 0:
                self._events[b].set()
                self._changed.notify_all()

    def _end_of_backward(self) -> None:
        # every gradient of this backward is computed: pieces issued before this point
        # overlapped the backward
        self.tracer.instant("gradients_ready")
        if self.trace_backward:
            self.tracer.compute("backward", self._backward_t0_us, self.tracer.now())
        self._backward_s = time.perf_counter() - self._backward_t0_s
        self._mark_all()
        if not self.overlap:
            return
        if self.single_thread:
            self._issue_ready()
        else:
            self._start_thread()

    def _mark_all(self) -> None:
        # A parameter unused in this step still takes part (as zeros, like stock
        # DeepSpeed): every rank must reduce the same buffers.
        for i, p in enumerate(self.params):
            if not self._ready[i]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._mark(i)

    # ------------------------------------------------------------------ communication
    def _flatten(self, b: int) -> torch.Tensor:
        bucket = self.schedule.buckets[b]
        grads = [self._grads[t].detach().reshape(-1) for t in bucket.tensors]
        flat = self._flat[b]
        if flat is None or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = self._flat[b] = torch.empty(bucket.numel, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat(grads, out=flat)
        return flat

    def _issue(self, piece) -> None:
        """Issue one piece (its bucket is complete), after a credit is free."""
        self._make_room(piece)
        self._launch(piece)

    def _make_room(self, piece) -> None:
        if piece.bucket not in self._flattened:
            self._flatten(piece.bucket)
            self._flattened.add(piece.bucket)
        self._wait_credit()

    def _launch(self, piece) -> None:
        view = self._flat[piece.bucket].narrow(0, piece.start, piece.numel)
        if self.two_level is not None and view.device.type == "cpu":
            pending = collectives.all_reduce_two_level_async(view, self.two_level.node_group, self.two_level.rail_group)
        else:
            pending = collectives.all_reduce_async(view, self.group)
        self._inflight.append((pending, piece))
        with self._issued_cond:
            self._issued[(piece.bucket, piece.index)] = pending
            self._issued_cond.notify_all()

    def _gate_opened(self) -> None:
        if self._started and self.overlap:
            self._issue_ready()

    def _issue_ready(self, force: bool = False) -> None:
        """Single-thread mode: issue the list's next pieces while their buckets are
        complete (and, unless ``force``, no exchange is in flight)."""
        order = self.schedule.issue_order
        while self._next < len(order):
            if not force and self.gate is not None and self.gate.busy:
                return  # the gate calls back when it opens
            piece = order[self._next]
            if not self._events[piece.bucket].is_set():
                return
            self._next += 1
            self._issue(piece)

    def _run(self) -> None:
        """The communication thread: the static list in order, or the live queue."""
        if self.live_queue:
            return self._run_live()
        try:
            for piece in self.schedule.issue_order:
                self._events[piece.bucket].wait()
                self._make_room(piece)  # credit waits happen outside the issue slot
                with self.gate.idle() if self.gate is not None else contextlib.nullcontext():
                    self._launch(piece)  # the gate's lock is not held here
            while self._inflight:
                self._complete(self._inflight.pop(0))
        except BaseException as exc:  # surfaced by finish() on the training thread
            self._error = exc

    def _run_live(self) -> None:
        """The live priority queue (see the module doc)."""
        try:
            buckets = self.schedule.buckets
            agreed = [False] * len(buckets)
            unagreed = len(buckets)
            queue: List[tuple] = []  # (piece_key, piece) of buckets ready on every rank
            left = len(self.schedule.issue_order)
            rounds = 0
            while left:
                self._wait_credit()
                if unagreed:
                    # same decision on every rank: the queue holds only agreed pieces
                    if not queue:
                        self._wait_for_news(agreed)
                    t_agree = self.tracer.now()
                    for b in self._agree():
                        if not agreed[b]:
                            agreed[b] = True
                            unagreed -= 1
                            for piece in self.schedule.pieces_of(b):
                                heapq.heappush(queue, (piece_key(buckets, piece, self.schedule.options), piece))
                    rounds += 1
                    self.tracer.instant("agreed", began_us=t_agree, ready_everywhere=len(agreed) - unagreed)
                    if not queue:
                        continue
                # every free credit now, most urgent first (how many is the same on every
                # rank: credits come back only in _wait_credit, oldest first)
                while queue and len(self._inflight) < self.schedule.options.max_in_flight:
                    _, piece = heapq.heappop(queue)
                    self._make_room(piece)
                    with self.gate.idle() if self.gate is not None else contextlib.nullcontext():
                        self._launch(piece)  # the gate's lock is not held here
                    left -= 1
            self.agreement_rounds = rounds
            while self._inflight:
                self._complete(self._inflight.pop(0))
        except BaseException as exc:  # surfaced by finish() on the training thread
            self._error = exc

    def _wait_credit(self) -> None:
        while len(self._inflight) >= self.schedule.options.max_in_flight:
            self._complete(self._inflight.pop(0))

    def _wait_for_news(self, agreed: List[bool]) -> None:
        """Block until a bucket is ready here that the ranks have not agreed on yet."""
        with self._changed:
            while not any(e.is_set() and not a for e, a in zip(self._events, agreed)):
                self._changed.wait()

    def _agree(self) -> List[int]:
        """The buckets ready on every rank (collective on the agreement group)."""
        flags = torch.tensor([1 if e.is_set() else 0 for e in self._events], dtype=torch.int32)
        if self.agree_group is not None:
            collectives.all_reduce(flags, op="min", group=self.agree_group)
        return [b for b, f in enumerate(flags.tolist()) if f]

    def _complete(self, item: tuple) -> None:
        pending, piece = item
        pending.synchronize()  # finished, not only ordered: a CUDA event on GPUs
        pending.wait()
        nbytes, inter = self._dense_bytes(piece.numel, self._flat[piece.bucket])
        for ledger in self.ledgers:
            ledger.record(K.DENSE_GRAD, nbytes, nbytes, inter)
        self.tracer.collective(K.DENSE_GRAD, piece.nbytes, pending.issued_us, pending.end_us(), bucket=piece.bucket,
                               piece=piece.index)

    def _dense_bytes(self, numel: int, flat: torch.Tensor) -> Tuple[int, Optional[int]]:
        """Bytes this rank sends for one piece, and how many of them leave its node (None:
        no topology, every rank counted as a node of its own)."""
        esize, t = flat.element_size(), self.topology
        if self.two_level is not None and flat.device.type == "cpu":
            # chunks exchanged inside the node twice, this rank's chunk all-reduced across nodes
            mine = collectives.chunk_sizes(numel, t.ranks_per_node)[t.local_of(collectives.rank())]
            across = ring_allreduce_bytes_int(mine * esize, t.num_nodes)
            return (numel - mine) * esize + (t.ranks_per_node - 1) * mine * esize + across, across
        # ring all-reduce (in rank order): each rank sends and receives 2 (N-1)/N of the
        # payload, to the next rank: across nodes from the last rank of each node
        nbytes = ring_allreduce_bytes_int(numel * esize, self.world_size)
        if t is None:
            return nbytes, None
        last_of_node = t.local_of(collectives.rank()) == t.ranks_per_node - 1 and t.num_nodes > 1
        return nbytes, nbytes if last_of_node else 0

    # ------------------------------------------------------------------ completion
    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every piece, then leave the averaged gradients in ``.grad``.

        Call on every rank before the optimizer step of a reducing backward. Also
        safe when no hook fired (e.g. a step without dense gradients): the list is
        then run in full on zeros, as on every other rank.
        """
        if not self._started:
            self._started = True
        self._step_ended()
        self._mark_all()
        try:
            if self.single_thread:
                self._issue_ready(force=True)
                while self._inflight:
                    self._complete(self._inflight.pop(0))
            else:
                self._start_thread()
                self._thread.join()
            error = self._error
            if error is not None:
                raise RuntimeError(f"dense gradient all-reduce failed: {error}") from error
            self._average()
        finally:
            self._reset()
        self.measure_rates()

    def _step_ended(self) -> None:
        # at finish()/defer(): a point every rank reaches, hooks fired here or not
        self._last_backward_s = self._backward_s

    def measure_rates(self) -> None:
        """After the first reduced step: its backward rate (the slowest rank's) and the
        start-up link rate into the static list; nothing later or when both rates were
        configured. Collective the first time: every rank calls it at the same point,
        with no step in flight (:meth:`finish` does; a deferred step's caller after
        :meth:`drain`)."""
        if not self._measure_backward or self._last_backward_s is False:
            return
        self._measure_backward = False
        seconds = self._last_backward_s
        grad_bytes = sum(t.nbytes for t in self.schedule.tensors)
        compute = rates.backward_bytes_per_s(grad_bytes, seconds, self.group)
        self.schedule.resimulate(compute, self._link_rate)
        self.rates = (compute, self._link_rate)
        logger.info("EmbRace 2D schedule: measured backward %.3g B/s, all-reduce %.3g B/s; static issue list "
                    "re-simulated (%s)", compute, self._link_rate,
                    "followed" if self.single_thread else "the live queue orders the pieces")

    def _average(self) -> None:
        for bucket in self.schedule.buckets:
            self._average_bucket(bucket.index)

    def _average_bucket(self, b: int) -> None:
        bucket = self.schedule.buckets[b]
        flat = self._flat[b]
        if self.world_size > 1:
            flat.div_(self.world_size)
        offset = 0
        for t in bucket.tensors:
            p = self.params[t]
            view = flat[offset : offset + p.numel()].view_as(p)
            if self._deferred:
                p.grad = view  # .grad was cleared at defer(); the buffer lives until the next backward
            else:
                p.grad.copy_(view)
            offset += p.numel()

    # ------------------------------------------------------------------ deferred completion
    @torch.no_grad()
    def defer(self) -> None:
        """End a reducing backward *without* waiting: every piece is (or will be) issued,
        each dense parameter's ``.grad`` is cleared (so an optimizer step now skips it),
        and :meth:`wait_bucket` later puts a bucket's average into ``.grad``. Call
        :meth:`drain` after the last :meth:`wait_bucket`, before the next backward.
        Every rank calls it where it would call :meth:`finish`."""
        if not self._started:
            self._started = True
        self._step_ended()
        self._mark_all()
        self._deferred = True
        if self.single_thread:
            self._issue_ready(force=True)
        else:
            self._start_thread()
        for p in self.params:
            p.grad = None

    @property
    def deferred(self) -> bool:
        """A :meth:`defer` whose :meth:`drain` has not run yet."""
        return self._deferred

    @torch.no_grad()
    def wait_bucket(self, b: int) -> List[torch.nn.Parameter]:
        """Deferred step: wait for bucket ``b``'s pieces, leave its average in ``.grad``
        of its parameters and return them. Once per bucket; on NCCL the wait orders the
        current stream after the all-reduce (no host wait)."""
        if not self._deferred:
            raise RuntimeError("wait_bucket() outside a deferred step")
        params = [self.params[t] for t in self.schedule.buckets[b].tensors]
        if b in self._averaged:
            return params
        for piece in self.schedule.pieces_of(b):
            with self._issued_cond:
                while (piece.bucket, piece.index) not in self._issued:
                    if self._error is not None:
                        raise RuntimeError(f"dense gradient all-reduce failed: {self._error}") from self._error
                    self._issued_cond.wait(timeout=1.0)
                pending = self._issued[(piece.bucket, piece.index)]
            pending.wait()
        self._average_bucket(b)
        self._averaged.add(b)
        return params

    def drain(self) -> None:
        """Deferred step: wait for the rest of the communication (and its accounting)
        and reset for the next backward. Every bucket must have been waited for."""
        if not self._deferred:
            return
        missing = [b.index for b in self.schedule.buckets if b.index not in self._averaged]
        try:
            if self.single_thread:
                while self._inflight:
                    self._complete(self._inflight.pop(0))
            elif self._thread is not None:
                self._thread.join()
            error = self._error
            if error is not None:
                raise RuntimeError(f"dense gradient all-reduce failed: {error}") from error
            if missing:
                raise RuntimeError(f"drain() before wait_bucket() of buckets {missing}")
        finally:
            self._reset()
