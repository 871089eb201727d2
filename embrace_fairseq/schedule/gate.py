"""The exchange gate: the embedding's gradient exchange as the first item of the dense
schedule, and the scope a table runs its gradient exchange in.

Split from the executor (``schedule/executor.py``), which orchestrates the dense
all-reduce around it."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager, Iterator, List, Optional


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
        self._enter_listeners: List[Callable[[], None]] = []
        self.entered = 0  # exchanges begun, ever
        self.left = 0  # exchanges ended, ever

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy > 0

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (outside the lock) each time the gate opens."""
        self._listeners.append(fn)

    def add_enter_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (outside the lock) each time an exchange is about to begin, before
        the gate closes: where the single-thread issue mode settles the pieces every rank
        issues before the exchange (``schedule/issue.py``)."""
        self._enter_listeners.append(fn)

    def enter(self) -> None:
        for fn in list(self._enter_listeners):
            fn()
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

