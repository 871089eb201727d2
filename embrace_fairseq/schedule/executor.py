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
communicators can wait on each other on the device (any group whose backend for the
parameters' device is NCCL, ``"cpu:gloo,cuda:nccl"`` included:
:func:`~embrace_fairseq.core.collectives.issues_from_one_thread`), or where
``EMBRACE_SINGLE_THREAD_ISSUE=1`` asks for it -- there is no thread: the pieces are
issued from the autograd thread itself, following the schedule's static list, and the
list's prefix issued before each other collective of that thread is agreed at a fence
before it, so every rank issues every collective (dense pieces, embedding exchanges, a
loss's gathers) in one order whatever gradients it gets (``schedule/issue.py`` says how
and why). Credits wait for the oldest piece in flight to *finish* (a CUDA event there;
``work.wait()`` on NCCL does not block the host), and trace times come from the same
events (from the work's future on gloo). No lock is held across a collective.

Times on CUDA come from the device: a piece's start and end (events on its group's wait
stream), backward from events on the current stream at the first gradient hook and at
the end of backward, all placed on the host clock through one anchor per device; the
link rate is measured on a buffer on the device the group uses. On CPU they are host
times, as before.

Average convention: the sum over ranks divided by the world size (what DDP and stock
DeepSpeed leave in ``.grad``), each rank's part divided *before* the sum, as DDP's default
hook does (fp16 headroom). Framework-agnostic: the caller says when a backward is the one
to reduce (``active``) and calls :meth:`finish` before the optimizer step.

The class is split along its seams: issuing (``schedule/issue.py``), the communication
thread and live queue (``schedule/live_queue.py``), completion tracking
(``schedule/completion.py``), the exchange gate (``schedule/gate.py``); this module
orchestrates them: readiness from the hooks, the step's begin and end, the rates.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from embrace_fairseq.core import collectives
from embrace_fairseq.core.ledger import CommLedger, global_ledger
from embrace_fairseq.core.node_topology import NodeGroups, NodeTopology, node_groups
from embrace_fairseq.core.trace import Tracer, clock_name
from embrace_fairseq.schedule import rates
from embrace_fairseq.schedule.completion import CompletionMixin
from embrace_fairseq.schedule.gate import ExchangeGate, gate_scope
from embrace_fairseq.schedule.issue import IssueMixin
from embrace_fairseq.schedule.live_queue import LiveQueueMixin
from embrace_fairseq.schedule.plan import Schedule

__all__ = ["ExchangeGate", "ScheduledAllReduce", "gate_scope"]

logger = logging.getLogger(__name__)


class ScheduledAllReduce(IssueMixin, LiveQueueMixin, CompletionMixin):
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
            static list's order, with fences (``schedule/issue.py``). ``None`` (default):
            where the group's backend for the parameters' device needs one issue order
            across groups (NCCL). ``EMBRACE_SINGLE_THREAD_ISSUE=1`` forces it on.
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
        module: the model whose outputs anchor the end of backward in the outermost
            backward (:meth:`_watch_module`). Without it, the end is the end of the backward
            the first gradient hook fires in: with reentrant activation checkpointing
            (``fairseq-train --checkpoint-activations``) that is a layer's recompute, and
            the hook of a gradient that comes after it raises.
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
        module: Optional[torch.nn.Module] = None,
    ) -> None:
        if len(params) != len(schedule.tensors):
            raise ValueError(f"schedule was built for {len(schedule.tensors)} tensors, got {len(params)} parameters")
        self.params = list(params)
        self.schedule = schedule
        self.group = group
        self.world_size = collectives.world_size(group)
        #: the device the dense gradients live on (timing events, the link's buffer)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if collectives.single_thread_forced():
            single_thread = True
        elif single_thread is None:
            single_thread = collectives.is_distributed() and collectives.issues_from_one_thread(group, self.device)
        self.single_thread = bool(single_thread)
        self.overlap = overlap
        self.active = active
        self.ledgers = [global_ledger()] + ([ledger] if ledger is not None and ledger is not global_ledger() else [])
        self.tracer = tracer or Tracer(enabled=False)
        self.trace_backward = trace_backward
        self.gate = gate
        if gate is not None and self.single_thread:
            gate.add_listener(self._gate_opened)
            gate.add_enter_listener(self._gate_entering)
        # single-thread mode: the host-side vote of the fences, and the fence itself
        self._vote_group = self._vote_group_for(group, self.world_size) if self.single_thread else None
        self._board = self._board_for(self._vote_group)  # what peers issued, for a rank at a fence
        self._backward_seq = -1  # reduced backwards begun, counted in _reset (the same on every rank)
        #: fence votes taken (single-thread mode), for logs and tests
        self.fence_rounds = 0
        #: the parameters (indices) without a gradient in the last reduced step
        self.no_grad_last_step: List[int] = []
        self._steps_reduced = 0
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
                and not self.single_thread and collectives.backend_for(group, "cpu") == "gloo"):
            self.two_level = node_groups(topology, purpose="dense")  # collective; None on one node
        #: agreement rounds of the last reduced step (live queue), for logs and tests
        self.agreement_rounds = 0
        # rates not set in the options are measured: the link now, backward at the
        # first reduced step and again at the WARM_STEP-th, each time re-simulating the list
        opts = schedule.options
        #: the reduced step whose backward is measured next (None: none, or configured)
        self._measure_backward_at: Optional[int] = 1 if opts.compute_bytes_per_s is None else None
        self._backward_steps = 0  # reduced steps ended on this rank (the same on every rank)
        # the configured rate, kept: resimulate() writes the rates it used into the options
        self._link_configured = opts.link_bytes_per_s is not None
        self._link_rate = opts.link_bytes_per_s
        if self._link_rate is None:
            self._link_rate = self._measure_link()
        if self._measure_backward_at is None and opts.link_bytes_per_s is None:
            schedule.resimulate(opts.compute_bytes_per_s, self._link_rate)
        #: (backward, link) bytes per second the static list was last simulated with
        self.rates = (schedule.options.compute_rate, self._link_rate)
        # seconds from the first gradient hook to the end of the last reduced backward on
        # this rank (None: no hook fired, or no reduced step yet: _backward_steps says which)
        self._last_backward_s: Optional[float] = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        if module is not None:
            self._watch_module(module)
        self._reset()
        if self.single_thread:
            collectives.add_issue_fence(self._fence)

    # ------------------------------------------------------------------ per step state
    def _reset(self) -> None:
        self._started = False
        self._end_queued = False  # the end-of-backward callback is queued in this backward
        self._backward_s: Optional[float] = None  # this step's, from the first hook (None: none fired)
        self._ready = [False] * len(self.params)
        self._missing = [len(b.tensors) for b in self.schedule.buckets]
        self._events = [threading.Event() for _ in self.schedule.buckets]
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._next = 0  # single-thread mode: index of the next piece of the issue list
        self._segment = 0  # single-thread mode: fence votes taken in this backward
        self._backward_seq += 1
        self._zeroed: set = set()  # single-thread mode: parameters a fence completed with zeros
        self._no_grad: set = set()  # parameters without a gradient in this backward
        self._bw_events: List[Any] = []  # CUDA: events at the first hook and at the end of backward
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
        collectives.remove_issue_fence(self._fence)

    # ------------------------------------------------------------------ readiness
    def _watch_module(self, module: torch.nn.Module) -> None:
        """Anchor the end of backward in the outermost backward: a forward hook on
        ``module`` puts a gradient hook on its outputs, which queues the end-of-backward
        callback when their gradient arrives.

        A reentrant activation checkpoint (fairseq's ``checkpoint_wrapper``, torch's
        ``checkpoint(use_reentrant=True)``, DeepSpeed's) recomputes its layer and runs a
        backward of its own inside the step's: a callback queued from a gradient hook
        that fires there runs when that layer is done, not the step's backward. The
        model's outputs belong to the step's backward and their gradient comes before
        any parameter's inside the model, as DDP's ``_DDPSink`` puts its callback there.
        """
        self._handles.append(module.register_forward_hook(self._watch_outputs))

    def _watch_outputs(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        for t in tree_leaves(outputs):  # in nested tuples, lists, dicts
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        # not while a deferred step is undrained: the first gradient hook raises for that
        if self.active() and not self._deferred:
            self._queue_end_of_backward()

    def _queue_end_of_backward(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            # runs once the backward this is called in is done: covers parameters without a gradient
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.active():
                return
            self._check_drained()  # a deferred step is still started: its state is not this backward's
            if not self._started:
                self._begin_backward()
            if self.single_thread:
                self._check_not_zeroed(i)
            if i in self._no_grad:  # zeros were reduced for it at an end of backward
                raise RuntimeError(
                    f"EmbRace 2D schedule: the gradient of dense parameter {i} {tuple(param.shape)} arrived after the "
                    "end of its backward was taken, which reduced zeros for it. A backward ran inside the step's "
                    "(reentrant activation checkpointing) and the step's end was taken at its end: give the "
                    "reducer the model (ScheduledAllReduce(..., module=model)) so that the model's outputs mark "
                    "the step's backward")
            self._mark(i)
            if self.single_thread and self.overlap:
                self._issue_ready()

        return hook

    def _begin_backward(self) -> None:
        """A reducing backward began (its first hook, or a fence before any hook)."""
        self._begin()
        self._queue_end_of_backward()  # a no-op where the model's outputs queued it

    def _check_drained(self) -> None:
        if self._deferred:
            raise RuntimeError("a reducing backward began while the previous step's deferred all-reduce was not "
                               "drained: complete its buckets (NextForwardUpdates.flush) before the next backward")

    def _begin(self) -> None:
        self._check_drained()
        self._started = True
        self._backward_t0_s = time.perf_counter()
        self._backward_t0_us = self.tracer.now()
        if self.device.type == "cuda":  # backward runs on the device: time it there
            self._bw_events = [collectives.record_event(self.device)]
        if self.overlap and not self.single_thread:
            self._start_thread()

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
        if not self._started:  # no dense gradient and no fence in it: finish() does the rest
            return
        self.tracer.instant("gradients_ready")
        if self._bw_events:
            self._bw_events.append(collectives.record_event(self.device))  # read at the step's end
        else:
            if self.trace_backward:
                self.tracer.compute("backward", self._backward_t0_us, self.tracer.now())
            self._backward_s = time.perf_counter() - self._backward_t0_s
        self._mark_all()
        if not self.overlap:
            return
        if self.single_thread:
            self._issue_ready(blocking=True)
        else:
            self._start_thread()

    def _device_backward(self) -> None:
        """CUDA: the backward's time from its device events (once the step ended)."""
        if len(self._bw_events) != 2:
            return
        t0, t1 = (collectives.event_us(ev, self.device) for ev in self._bw_events)
        self._bw_events = []
        if self.trace_backward:  # timed on the device, as its collectives
            self.tracer.compute("backward", t0, t1, clock=clock_name(self.device))
        self._backward_s = (t1 - t0) / 1e6

    def _mark_all(self) -> None:
        # A parameter unused in this step still takes part (as zeros, like stock
        # DeepSpeed): every rank must reduce the same buffers.
        for i, p in enumerate(self.params):
            if not self._ready[i]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._no_grad.add(i)
                self._mark(i)

    def _log_no_grad(self) -> None:
        """With ``EMBRACE_ISSUE_LOG=DIR``: one line per reduced step in
        ``DIR/nograd.rank<N>.log``, the parameters (by index) that got no gradient in it
        (``-``: none), to check what a run's ranks differed in."""
        self.no_grad_last_step = sorted(self._no_grad)
        self._steps_reduced += 1
        path = os.environ.get("EMBRACE_ISSUE_LOG")
        if path:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"nograd.rank{collectives.rank()}.log"), "a") as f:
                f.write(f"{self._steps_reduced} {','.join(map(str, self.no_grad_last_step)) or '-'}\n")


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
                self._issue_ready(force=True, blocking=True)
                while self._inflight:
                    self._complete(self._inflight.pop(0))
            else:
                self._start_thread()
                self._thread.join()
            error = self._error
            if error is not None:
                raise RuntimeError(f"dense gradient all-reduce failed: {error}") from error
            self._average()
            self._log_no_grad()
        finally:
            self._reset()
        self.measure_rates()

    def _step_ended(self) -> None:
        # at finish()/defer(): a point every rank reaches, hooks fired here or not
        self._device_backward()
        self._last_backward_s = self._backward_s
        self._backward_steps += 1

    #: the reduced step whose backward is measured again, warm: the first one is cold (on a
    #: GPU its kernels load and cuBLAS builds its handles, which took an H200's first
    #: backward of a small model seconds; on a CPU the allocator faults its pages in)
    WARM_STEP = 3

    def measure_rates(self) -> None:
        """After the first reduced step, and again after the :attr:`WARM_STEP`-th: the
        step's backward rate (the slowest rank's) and the link rate into the static list;
        nothing else, or when both rates were configured. Collective when it measures:
        every rank calls it at the same point, with no step in flight (:meth:`finish`
        does; a deferred step's caller after :meth:`drain`)."""
        at = self._measure_backward_at
        if at is None or self._backward_steps < at:
            return
        warm = at > 1
        self._measure_backward_at = None if warm else self.WARM_STEP
        seconds = self._last_backward_s
        grad_bytes = sum(t.nbytes for t in self.schedule.tensors)
        compute = rates.backward_bytes_per_s(grad_bytes, seconds, self.group)
        self.schedule.resimulate(compute, self._link_rate)
        self.rates = (compute, self._link_rate)
        self._log_rates(f"measured backward ({'warm, step ' + str(self._backward_steps) if warm else 'first step'})")

    def remeasure_link(self) -> None:
        """The link changed since start-up: measure it again and re-simulate the static
        list with it (and the backward rate, once measured). For jobs whose links change
        under them, as the benchmark's emulated links between rounds; a list simulated
        for another link orders the pieces for that link (for a link a hundred times
        faster: plain readiness order). Collective, with no step in flight; nothing where
        the configuration sets the link's rate.

        Example::

            reducer.remeasure_link()  # every rank, between steps, after the link changed
        """
        if self._link_configured:
            return
        if self._deferred:
            raise RuntimeError("remeasure_link() with a step's all-reduce still running: drain it first")
        self._link_rate = self._measure_link()
        self.rates = (self.rates[0], self._link_rate)
        if self._measure_backward_at == 1:  # the first reduced step simulates the list with it
            return
        self.schedule.resimulate(*self.rates)
        self._log_rates("link re-measured; backward")

    def _measure_link(self) -> float:
        return rates.measure_link_bytes_per_s(self.schedule.options.piece_bytes, self.group, device=self.device)

    def _log_rates(self, what: str) -> None:
        logger.info("EmbRace 2D schedule: %s %.3g B/s, all-reduce %.3g B/s; static issue list re-simulated (%s)",
                    what, self.rates[0], self.rates[1],
                    "followed from the autograd thread" if self.single_thread
                    else "the live queue orders the pieces" if self.live_queue
                    else "followed by the communication thread")


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
            self._issue_ready(force=True, blocking=True)
        else:
            self._start_thread()
        for p in self.params:
            p.grad = None

    @property
    def deferred(self) -> bool:
        """A :meth:`defer` whose :meth:`drain` has not run yet."""
        return self._deferred
