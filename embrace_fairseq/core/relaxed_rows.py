"""The relaxed embedding dependency: finish the rows the next batch does not read late.

At step k the table rows split in two by the ids of batch k+1 over *all* ranks (``G``):

* rows in ``G``: their gradient rows travel in backward as usual (synchronous AlltoAll)
  and they are updated at the optimizer step, so the next forward reads them updated;
* the other rows: their gradient rows travel with an asynchronous AlltoAll on a process
  group of its own (issued in backward, in the autograd order, which is the same on
  every rank), and a background thread waits for it and applies their update while the
  next forward runs.

Results stay those of synchronous training: the optimizer is element-wise and steps the
two row sets with the same step number (a :class:`RowStepper` such as
:class:`embrace_fairseq.optim.shard_optimizer.ShardOptimizer`),
and nothing reads a deferred row before its update is done: a lookup that asks an owner
for a row outside ``G`` (wrong or missing ``next_batch`` ids) waits for the deferred work
first; full-table reads (tied output projection, checkpoints) and the next backward and
step wait too. Without ``G`` (no ids given) every row is deferred and the next lookup waits.

Not combinable with anything that needs every gradient row at the step: gradient-norm
clipping and fp16 overflow checks (refused at start-up), gradient accumulation over
several micro-batches. Non-finite deferred gradients are detected when the deferred work
is joined (a collective on the training thread), one step later than the others.

On CUDA the background thread works on a stream of its own (a thread's current stream
is otherwise the legacy default stream, which would serialise its work with the next
forward): it first waits for an event recorded on the stepping thread's stream (the
priority rows and gradients are ready), and records an event after its last row write.
Whoever reads a deferred row waits for the thread (host) and then makes its own current
stream wait for that event (device), so a non-default main stream is ordered after the
row writes too. The tensors the side stream reads that the main stream allocated
(gradients, received rows, row indices) are held until that wait, so the caching
allocator cannot hand their memory to the main stream while the side stream reads it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.native_ops import host_ints
from embrace_fairseq.core.output_dist import push_grad_rows as sync_push
from embrace_fairseq.core.trace import Tracer, clock_for

DEFERRED_TID = 3
DEFERRED_GRAD_ROWS = "deferred_grad_rows"


class RowStepper(Protocol):
    """What the relaxed rows need of an optimizer over the tables' shards (the shard
    optimizer of :mod:`embrace_fairseq.optim` is one): an element-wise update of
    chosen rows, with the step number advanced once per step for all of them."""

    params: List[torch.Tensor]

    def begin_step(self, hp: Any) -> None: ...

    def apply(self, rows: Any = None, grad_scale: float = 1.0, grads: Any = None) -> None: ...


def _segment_counts(items: Sequence[Tuple[torch.Tensor, Sequence[int]]]) -> List[List[int]]:
    """Per mask, how many entries of each segment (``counts[r]`` consecutive entries) it
    keeps; one host sync for all masks (kept: the counts are AlltoAll split sizes, which
    torch.distributed takes as host integers)."""
    parts = []
    for mask, counts in items:
        ends = [0]
        for c in counts:
            ends.append(ends[-1] + int(c))
        kept = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])
        at = kept.index_select(0, host_ints(ends, mask.device))
        parts.append(at[1:] - at[:-1])
    if not parts:
        return []
    flat = torch.cat(parts).tolist() if sum(p.numel() for p in parts) else []
    out, i = [], 0
    for _, counts in items:
        out.append([int(x) for x in flat[i: i + len(counts)]])
        i += len(counts)
    return out


def _where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of ``mask``'s True entries, their number known on the host: no sync
    (``nonzero`` alone must read the count back from the device)."""
    try:
        return torch.nonzero_static(mask, size=count).flatten()
    except (AttributeError, NotImplementedError, RuntimeError):  # a build without it for this device
        return mask.nonzero().flatten()


class RelaxedRows:
    """Per-engine state of the relaxed dependency over a set of sharded tables.

    Args:
        tables: the ``ShardedEmbedding`` modules (their ``weight`` order is the shard
            optimizer's parameter order).
        group: process group for the deferred AlltoAlls (its own, see module doc).
        tracer: optional timeline (the deferred work appears on its own track).
    """

    def __init__(self, tables: Sequence[Any], group: Optional["dist.ProcessGroup"], tracer: Optional[Tracer] = None,
                 on_nonfinite: Optional[Callable[[List[str]], None]] = None) -> None:
        self.tables = list(tables)
        self.group = group
        self.tracer = tracer or Tracer(enabled=False)
        self._index = {id(t): i for i, t in enumerate(self.tables)}
        # G of the coming backward (set by next_batch) and G of the last update (what the
        # next forward may read without waiting), as sorted plan-order ids per table
        self._next: List[Optional[torch.Tensor]] = [None] * len(self.tables)
        self._updated: List[Optional[torch.Tensor]] = [None] * len(self.tables)
        self._split_with: List[Optional[torch.Tensor]] = [None] * len(self.tables)
        self._pending: List[tuple] = []  # (table index, work, recv rows, local rows, scale, padding, sent bytes)
        self._thread: Optional[threading.Thread] = None
        # CUDA: the background thread's stream, the event after its last row write (what a
        # reader's stream waits for), and the tensors it reads that the main stream made
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._done: Optional[Any] = None
        self._held: List[Any] = []
        #: CUDA: (begin, end) timing events of the last background update on its stream
        self.side_events: Optional[Tuple[Any, Any]] = None
        self._error: Optional[BaseException] = None
        self._nonfinite: List[str] = []
        for t in self.tables:
            t.relaxed = self

    # ------------------------------------------------------------------ next batch
    @torch.no_grad()
    def next_batch(self, ids_per_table: Sequence[Sequence[torch.Tensor]]) -> None:
        """Set ``G`` for the coming backward: the union over ranks of the ids each table
        will look up in the next batch. Collective (an all-gather of unique ids, on the
        device the table's group needs). ``G`` is kept on the table's device."""
        for ti, (table, ids_list) in enumerate(zip(self.tables, ids_per_table)):
            device = table.weight.device
            flat = [i.reshape(-1).to(device=device, dtype=torch.long) for i in ids_list if i is not None and i.numel()]
            mine = torch.unique(torch.cat(flat)) if flat else torch.zeros(0, dtype=torch.long, device=device)
            mine = mine[(mine >= 0) & (mine < table.num_embeddings)]
            mine = table.plan.to_plan(mine)  # G in plan order: the ids the exchange works with
            # torch.full, not torch.tensor: no blocking host-to-device copy
            sizes = collectives.all_gather(torch.full((1,), mine.numel(), dtype=torch.long, device=device), table.group)
            longest = int(torch.cat(sizes).max())  # kept: the padded size is a host integer (one sync)
            padded = torch.full((longest,), -1, dtype=torch.long, device=device)
            padded[: mine.numel()] = mine
            union = torch.unique(torch.cat(collectives.all_gather(padded, table.group)))
            self._next[ti] = union[union >= 0]
            nbytes = (len(sizes) - 1) * longest * 8
            if table.ledger is not None:
                table.ledger.record(K.IDS, nbytes, nbytes)

    # ------------------------------------------------------------------ backward split
    def push_grad_rows(self, table: Any, grad_unique: torch.Tensor, xp: Any, shard_rows: int, scale: float,
                       padding_local: Optional[int]) -> torch.Tensor:
        """Backward of a lookup: rows in ``G`` now (returned shard gradient), the rest
        asynchronously (applied by :meth:`finish_step`'s thread)."""
        ti = self._index[id(table)]
        g = self._next[ti]
        self._split_with[ti] = g
        device = xp.unique_ids.device
        g = torch.zeros(0, dtype=torch.long, device=device) if g is None else g.to(device)
        start, _ = xp.plan.shard_range(xp.rank)
        send_mask = torch.isin(xp.unique_ids, g)
        recv_mask = torch.isin(xp.requested_local + start, g)
        grad_unique = grad_unique.contiguous()
        dim = grad_unique.shape[1]
        # every split size of both exchanges from one host sync (kept: AlltoAll split sizes
        # are host integers); the row selections then need none
        send_in, recv_in = _segment_counts([(send_mask, xp.send_counts), (recv_mask, xp.recv_counts)])
        send_counts = [a - b for a, b in zip(xp.send_counts, send_in)]
        recv_counts = [a - b for a, b in zip(xp.recv_counts, recv_in)]
        # the rows in G: the ordinary exchange restricted to them
        sub = _Sub(xp, send_mask, recv_mask, send_in, recv_in)
        grad = sync_push(grad_unique.index_select(0, sub.send_rows), sub, shard_rows, scale, padding_local)
        # the others: issued now on the relaxed group, completed later
        send = grad_unique.index_select(0, _where(~send_mask, sum(send_counts)))
        recv = grad_unique.new_empty(sum(recv_counts), dim)
        work = collectives.all_to_all_single_async(recv, send, recv_counts, send_counts, self.group)
        rows = xp.requested_local.index_select(0, _where(~recv_mask, sum(recv_counts)))
        row_bytes = dim * grad_unique.element_size()
        sent = sum(c for r, c in enumerate(send_counts) if r != xp.rank) * row_bytes
        got = sum(c for r, c in enumerate(recv_counts) if r != xp.rank) * row_bytes
        for ledger in xp.ledgers:
            ledger.record(DEFERRED_GRAD_ROWS, sent, got)
        self._pending.append((ti, work, recv, rows, scale, padding_local, sent))
        return grad

    # ------------------------------------------------------------------ reads
    def before_lookup(self, table: Any, requested_local: torch.Tensor) -> None:
        """Called by an owner before it serves rows: wait if any is still deferred."""
        if self._thread is None:
            return
        ti = self._index[id(table)]
        start = table.shard_range[0]
        done = self._updated[ti]
        # kept host sync: whether to wait for the thread is a host decision
        if done is None or not bool(torch.isin(requested_local + start, done.to(requested_local.device)).all()):
            self.wait()

    def before_full_read(self, table: Any = None) -> None:
        self.wait()

    # ------------------------------------------------------------------ the step
    def priority_rows(self) -> List[torch.Tensor]:
        """Local rows (per table) whose update is due now: those in the ``G`` the last
        backward split with (all rows when it had none: nothing was deferred then)."""
        out = []
        for ti, t in enumerate(self.tables):
            g = self._split_with[ti]
            n, device = t.weight.shape[0], t.weight.device
            start = t.shard_range[0]
            if g is None and not any(p[0] == ti for p in self._pending):
                out.append(torch.arange(n, device=device))
            else:
                g = g.to(device) if g is not None else torch.zeros(0, dtype=torch.long, device=device)
                # kept host sync (once per step): the number of rows sizes their update
                local = g[(g >= start) & (g < start + n)] - start
                out.append(local)
        return out

    def step(self, opt: RowStepper, hp: Any) -> None:
        """Update the rows the next forward reads now; start the thread that finishes the
        others. Call at the optimizer step, on every rank, after the sync gradients are in."""
        self.wait()
        prio = self.priority_rows()
        opt.begin_step(hp)
        opt.apply(prio)
        grads = [p.grad for p in opt.params]  # kept: the framework may drop .grad after its step
        pending, self._pending = self._pending, []
        self._updated = [self._split_with[ti] for ti in range(len(self.tables))]
        self._split_with = [None] * len(self.tables)
        self._next = [None] * len(self.tables)
        side = ready = None
        device = self._cuda_device()
        if device is not None:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device=device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # priority rows and gradients are in
            # held until a reader's stream waits for the side stream (see module doc)
            self._held = [grads, prio, pending]
        self._thread = threading.Thread(target=self._finish, args=(opt, grads, prio, pending, side, ready),
                                        name="embrace-relaxed-rows", daemon=True)
        self._thread.start()

    def _cuda_device(self) -> Optional[torch.device]:
        devices = {t.weight.device for t in self.tables if t.weight.device.type == "cuda"}
        if len(devices) > 1:
            raise RuntimeError(f"relaxed rows over tables on several devices ({sorted(map(str, devices))})")
        return devices.pop() if devices else None

    def _finish(self, opt: RowStepper, grads: List[Optional[torch.Tensor]], prio: List[torch.Tensor],
                pending: List[tuple], side: Optional["torch.cuda.Stream"], ready: Optional[Any]) -> None:
        """The background thread: on CUDA on its own stream, ordered after ``ready``; the
        event after its last write becomes :attr:`_done` whatever happens."""
        if side is None:
            self._finish_rows(opt, grads, prio, pending)
            return
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            with torch.cuda.device(side.device), torch.cuda.stream(side):
                side.wait_event(ready)
                begin.record(side)
                try:
                    self._finish_rows(opt, grads, prio, pending)
                finally:
                    done.record(side)
                    self._done = done
                    self.side_events = (begin, done)
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = self._error or exc

    @torch.no_grad()
    def _finish_rows(self, opt: RowStepper, grads: List[Optional[torch.Tensor]], prio: List[torch.Tensor],
                     pending: List[tuple]) -> None:
        try:
            # the rows not updated at the step (on this thread: its host sync blocks no one)
            rest = []
            for ti, t in enumerate(self.tables):
                mask = torch.ones(t.weight.shape[0], dtype=torch.bool, device=t.weight.device)
                mask[prio[ti]] = False
                rest.append(mask.nonzero().flatten())
            # deferred gradient rows summed in fp32 (as stock embeddings sum half-precision rows)
            deferred = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in opt.params]
            starts: Dict[int, float] = {}
            sent_by: Dict[int, int] = {}
            ends: Dict[int, float] = {}
            clock = None
            for ti, work, recv, rows, scale, padding, sent in pending:
                work.wait()  # no collective issued here: only the wait for one issued in backward
                ends[ti] = max(ends.get(ti, 0.0), work.end_us())
                t0, clock = work.issued_us, clock_for(work.device)  # the trace's one clock (core/trace.py)
                d = deferred[ti]
                add = recv.float() * scale if scale != 1.0 else recv.float()
                d.index_add_(0, rows.to(d.device), add.to(d.device))
                if padding is not None:
                    d[padding].zero_()
                starts[ti] = min(starts.get(ti, t0), t0)
                sent_by[ti] = sent_by.get(ti, 0) + sent
            full = [(g + d) if g is not None else d for g, d in zip(grads, deferred)]
            bad = [t.__class__.__name__ + f"[{i}]" for i, (t, f) in enumerate(zip(self.tables, full))
                   if not bool(torch.isfinite(f[rest[i]]).all())]
            if bad:
                self._nonfinite = bad
                return
            opt.apply(rest, grads=full)
            if clock is not None and self.tracer.enabled:
                # the deferred rows are finished: exchanged (``ends``) and updated; on CUDA an
                # event on this thread's stream, after the collectives and the row writes
                end = clock.stamp()
                for ti, t0 in starts.items():
                    stop = max(end, ends[ti]) if isinstance(end, float) else end
                    self.tracer.collective(DEFERRED_GRAD_ROWS, sent_by[ti], t0, stop, tid=DEFERRED_TID,
                                           clock=clock.name, table=ti)
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the deferred rows are exchanged and updated (no collective). On
        CUDA the caller's current stream is ordered after the row writes (device side);
        the host waits only for the thread, which enqueued them."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        done, self._done = self._done, None
        if done is not None:
            torch.cuda.current_stream(self._cuda_device()).wait_event(done)
        self._held = []  # the reader's stream is ordered after the side stream: safe to free
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"deferred embedding rows failed: {err}") from err

    def take_nonfinite(self) -> List[str]:
        """Tables whose deferred gradient rows were non-finite at the last join (local)."""
        bad, self._nonfinite = self._nonfinite, []
        return bad


class _Sub:
    """An ExchangePlan restricted to the rows in G (for the synchronous part); the counts
    per rank are given (computed with the deferred ones in one host sync)."""

    def __init__(self, xp: Any, send_mask: torch.Tensor, recv_mask: torch.Tensor, send_counts: List[int],
                 recv_counts: List[int]) -> None:
        self.plan, self.group, self.rank, self.ledgers = xp.plan, xp.group, xp.rank, xp.ledgers
        self.off_node = xp.off_node
        self.send_counts = send_counts
        self.recv_counts = recv_counts
        self.send_rows = _where(send_mask, sum(send_counts))
        self.requested_local = xp.requested_local.index_select(0, _where(recv_mask, sum(recv_counts)))
        self.unique_ids = xp.unique_ids.index_select(0, self.send_rows)
