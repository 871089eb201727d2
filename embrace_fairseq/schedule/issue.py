"""Issuing the dense pieces: flattening a bucket, credits, the asynchronous all-reduce, and
the single-thread mode's one issue order on every rank.

Part of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce` (a mixin: the
executor holds the state and orchestrates; see its module doc for the modes).

**Pre-division.** A bucket is divided by the world size when it is flattened, before its
all-reduce, as DDP's default hook does: a sum of N half-precision gradients has N times
less headroom than a sum of their N-th parts.

**One issue order in the single-thread mode, by construction.** Where collectives of
different groups must be issued in one order on every rank (NCCL, or
``EMBRACE_SINGLE_THREAD_ISSUE=1``), the pieces are issued from the autograd thread in the
static list's order, and the list's prefix issued before any *other* collective of that
thread is a function of what every rank knows:

* in a gradient hook, the next pieces go out while their buckets are complete and a
  credit is free *without waiting* (a hook never blocks on a piece a peer may not have
  issued);
* **fences**: before every other collective the autograd thread issues during a reducing
  backward (an embedding exchange, its id and count gathers, a vocab-parallel loss's
  gathers: :func:`~embrace_fairseq.core.collectives.add_issue_fence`), and before the
  exchange gate closes, the ranks vote (MAX of the count issued, on a host-side gloo
  group of its own, outside the device issue order) and every rank issues the list up to
  the agreed count. A parameter that has no gradient on a rank at that point while a peer
  already reduced it counts as ready with zeros (what it contributes when it gets no
  gradient in this backward, as at the end of backward): the graph computes a
  parameter's gradient before or after a given collective the same way on every rank
  that computes it at all, so one that is missing here now never comes; if it does come
  later, the hook raises instead of reducing a wrong sum. Catching up waits for credits:
  every rank issues the same pieces then, so a credit waits only on pieces every rank
  has issued;
* while the exchange gate is closed nothing is issued on any rank (the gate's state is
  the same on every rank at the same point of the graph), so fences inside an exchange
  need no vote;
* at the end of backward every parameter is ready (zeros where none came) and the rest
  of the list goes out, waiting for credits.

**No rank waits in a vote for a host that waits for it.** A piece issued from a hook is
outside any agreement: when it is issued, its peers' halves may come only after the next
vote. A rank that is ahead can meet a device-wide synchronisation before its fence (the
CUDA caching allocator freeing its cache on an out-of-memory retry, ``empty_cache``): its
host then waits for its device, which waits in that piece for the peers. So a hook posts
the count it issues on the issue board first (``schedule/issue_board.py``: the job's
store, readable while the poster's host is blocked), and a rank waiting in a vote issues
up to the furthest count its peers posted for the same segment while the vote is in
flight -- what it would issue right after the vote anyway (the vote's result is at least
that count), only earlier. Stock DDP takes no host-side vote inside backward; this mode
takes one per fence, and never one that a peer's device can be waiting on.

So every rank issues: the pieces ``[0, n1)``, the first other collective, ``[n1, n2)``, the
next, ..., the rest at the end of backward, with the same ``n_k`` everywhere, whichever
parameters got a gradient and whenever. A fence costs one small host-side all-gather per
other collective of a reducing backward (and store reads while it waits); a piece issued
from a hook, one store write.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.schedule.issue_board import IssueBoard


class IssueMixin:
    """Issuing of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce`."""

    # ------------------------------------------------------------------ pieces
    def _flatten(self, b: int) -> torch.Tensor:
        bucket = self.schedule.buckets[b]
        grads = [self._grads[t].detach().reshape(-1) for t in bucket.tensors]
        flat = self._flat[b]
        if flat is None or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = self._flat[b] = torch.empty(bucket.numel, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat(grads, out=flat)
        if self.world_size > 1:
            flat.div_(self.world_size)  # before the sum: N times the headroom of dividing after
        return flat

    def _issue(self, piece) -> None:
        """Issue one piece (its bucket is complete), after a credit is free."""
        self._make_room(piece)
        self._launch(piece)

    def _prepare(self, piece) -> None:
        if piece.bucket not in self._flattened:
            self._flatten(piece.bucket)
            self._flattened.add(piece.bucket)

    def _make_room(self, piece) -> None:
        self._prepare(piece)
        self._wait_credit()

    def _launch(self, piece) -> None:
        view = self._flat[piece.bucket].narrow(0, piece.start, piece.numel)
        with collectives.fences_off():  # a piece is no other collective to fence
            if self.two_level is not None and view.device.type == "cpu":
                pending = collectives.all_reduce_two_level_async(view, self.two_level.node_group,
                                                                 self.two_level.rail_group)
            else:
                pending = collectives.all_reduce_async(view, self.group)
        self._inflight.append((pending, piece))
        with self._issued_cond:
            self._issued[(piece.bucket, piece.index)] = pending
            self._issued_cond.notify_all()

    def _wait_credit(self) -> None:
        while len(self._inflight) >= self.schedule.options.max_in_flight:
            self._complete(self._inflight.pop(0))

    def _credit_free(self) -> bool:
        """A credit is free now, waiting for nothing: finished pieces are completed."""
        while len(self._inflight) >= self.schedule.options.max_in_flight:
            if not self._inflight[0][0].done():
                return False
            self._complete(self._inflight.pop(0))
        return True

    # ------------------------------------------------------------------ single-thread mode
    def _gate_opened(self) -> None:
        if self._started and self.overlap:
            self._issue_ready()

    def _issue_ready(self, force: bool = False, blocking: bool = False) -> None:
        """Single-thread mode: issue the list's next pieces while their buckets are
        complete (and, unless ``force``, no exchange is in flight); ``blocking``: wait for
        credits, else stop at the first piece without a free credit."""
        order = self.schedule.issue_order
        while self._next < len(order):
            if not force and self.gate is not None and self.gate.busy:
                return  # the gate calls back when it opens
            piece = order[self._next]
            if not self._events[piece.bucket].is_set():
                return
            if blocking:
                self._make_room(piece)
            else:
                self._prepare(piece)
                if not self._credit_free():
                    return
            self._next += 1
            if not blocking:  # outside an agreement: posted first (schedule/issue_board.py)
                self._post_issued()
            self._launch(piece)

    def _post_issued(self) -> None:
        if self._board is not None:
            self._board.post(self._backward_seq, self._segment, self._next)

    def _catch_up(self, n: int) -> None:
        """Issue the list up to ``n`` pieces (the agreed count), buckets not complete here
        completed with zeros for the parameters without a gradient (see the module doc)."""
        order = self.schedule.issue_order
        while self._next < n:
            piece = order[self._next]
            if not self._events[piece.bucket].is_set():
                for t in self.schedule.buckets[piece.bucket].tensors:
                    if not self._ready[t]:
                        self._zero_fill(t)
                        self._zeroed.add(t)
                        self._no_grad.add(t)
            self._next += 1
            self._issue(piece)

    def _zero_fill(self, i: int) -> None:
        p = self.params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        self._mark(i)

    def _fence_applies(self) -> bool:
        if not (self.single_thread and self.overlap) or self._deferred:
            return False
        # inside a backward (the graph task is per thread: the autograd thread only)
        return torch._C._current_graph_task_id() != -1 and bool(self.active())

    def _fence(self, op: str, group: Any) -> None:
        """Before another collective of the autograd thread (see the module doc)."""
        if not self._fence_applies():
            return
        if self.gate is not None and self.gate.busy:
            return  # settled when the gate closed; nothing is issued meanwhile on any rank
        self._settle()

    def _gate_entering(self) -> None:
        if not self._fence_applies():
            return
        self._settle()

    def _settle(self) -> None:
        if not self._started:
            self._begin_backward()
        agreed = self._vote_max(self._next)
        self.fence_rounds += 1
        if agreed > self._next:
            self._catch_up(agreed)
        self._segment += 1  # on every rank: the posts of the next segment start here

    #: seconds a vote may take before the issue board is read (a vote whose ranks all came
    #: returns sooner; the board matters only where a peer is held up), and between reads
    BOARD_AFTER_S = 2e-3
    BOARD_POLL_S = 2e-3

    def _vote_max(self, n: int) -> int:
        """The largest count issued on any rank (``n`` here). While the vote is in flight
        this rank issues up to the furthest count its peers posted (the issue board): a
        peer that is ahead may be blocked on its device, waiting in a piece for this rank's
        half, and could not join the vote before it is issued."""
        if self._vote_group is None:
            return n
        t = torch.tensor([n], dtype=torch.long)
        with collectives.fences_off():
            pending = collectives.all_gather_async(t, self._vote_group)
        began = time.perf_counter()
        pause = 2e-5
        while not pending.done():
            if time.perf_counter() - began >= self.BOARD_AFTER_S:
                ahead = self._board.furthest(self._backward_seq, self._segment)
                if ahead > self._next:
                    self._catch_up(ahead)
            time.sleep(pause)
            pause = min(2 * pause, self.BOARD_POLL_S)
        return max(int(v.item()) for v in pending.wait())

    def _check_not_zeroed(self, i: int) -> None:
        if i in self._zeroed:
            raise RuntimeError(
                f"dense parameter {i} got its gradient after the ranks agreed, at a collective before it, that it "
                "had none in this backward (another rank had already reduced its bucket): this model computes the "
                "parameter's gradient on different sides of a collective on different ranks. Issue the dense "
                "all-reduce from a communication thread instead (a backend other than NCCL, without "
                "EMBRACE_SINGLE_THREAD_ISSUE), or turn overlap off")

    @staticmethod
    def _vote_group_for(group: Optional[Any], world: int) -> Optional[Any]:
        if world <= 1 or not collectives.is_distributed():
            return None
        ranks: Optional[List[int]] = None if group is None else dist.get_process_group_ranks(group)
        return collectives.new_group(ranks, host_vote=True)

    @staticmethod
    def _board_for(vote_group: Optional[Any]) -> Optional[IssueBoard]:
        if vote_group is None:
            return None
        return IssueBoard(collectives.group_label(vote_group), dist.get_process_group_ranks(vote_group))
