"""The communication thread of the dense all-reduce: the static list in order, or the live
priority queue over the buckets every rank agreed are ready.

Part of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce` (a mixin: the
executor holds the state and orchestrates; its module doc describes both orders).
"""
from __future__ import annotations

import contextlib
import heapq
import threading
from typing import List

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.schedule.plan import piece_key


class LiveQueueMixin:
    """The communication thread of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce`."""

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="embrace-allreduce", daemon=True)
            self._thread.start()

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

