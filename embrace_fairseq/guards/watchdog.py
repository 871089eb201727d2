"""Peer watchdog: a rank whose peer died or hung stops within a bounded time, naming it.

A collective with a dead peer does not always fail: gloo may wait for its full timeout
(30 minutes by default) and NCCL may wait forever. torchrun's agent kills the other
workers when one exits, but ranks started otherwise (``run_ranks``, the ``deepspeed``
launcher on several hosts, ``fairseq-train --distributed-init-method tcp://...`` per
process) have nobody to do that. Each rank therefore runs a small daemon thread over
the rendezvous store torch.distributed already has:

* every ``interval`` it writes its heartbeat counter (``hb/<rank>``);
* it reads the peers' counters; a counter that has not moved for ``timeout`` seconds
  means the peer is lost (hung, stopped, or on a host that went away);
* peers on the same host also publish their process id, so a killed peer is seen
  within one interval instead of after the timeout;
* a rank that ends publishes ``exit/<rank>`` = ``ok`` or ``failed: <error>``; peers do
  not count a clean exit as a loss, and a failure is reported by the others if they
  are still running ``failure_grace`` seconds later (they are then most likely blocked
  in a collective the failed rank will never join);
* the store itself unreachable for ``timeout`` seconds (its host, rank 0 for ``tcp://``
  and ``env://`` rendezvous without torchrun, is gone) counts as a loss too.

The thread ends before the interpreter does: :func:`stop` (at exit) joins it. A daemon
thread still inside a store call when Python finalizes is ended by the interpreter
(``pthread_exit``) as it takes the GIL back, and the unwinding through c10d's C++ frames
aborts the process (``terminate called without an active exception``, exit 134, after a
run that was complete).

On a loss it logs ``rank K lost: ...`` to stderr (``ranks K, L lost: rank K: ...; rank L:
...`` when several are: a node that goes away takes all its ranks, and one more round
after the first loss lets those seen a round later be named too) and ends the process
with :data:`LOST_PEER_EXIT_CODE` (``os._exit``: a thread blocked in a collective cannot
be interrupted otherwise). ``EMBRACE_PEER_TIMEOUT_S`` sets the timeout (default 60; 0
turns the watchdog off).
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

#: Environment variable: seconds without a heartbeat before a peer counts as lost (0: off).
TIMEOUT_ENV = "EMBRACE_PEER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
#: Exit status of a rank stopped because a peer was lost.
LOST_PEER_EXIT_CODE = 43
#: Seconds :meth:`PeerWatchdog.stop` waits for the thread's round in progress (store
#: calls of milliseconds; the bound covers a store host that stopped answering)
JOIN_TIMEOUT_S = 5.0
_PREFIX = "embrace_watchdog/"


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be >= 0 (0 turns the watchdog off)")
    return value


def _proc_start_time(pid: int) -> Optional[str]:
    """Start time of a process (field 22 of /proc/<pid>/stat), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: split after its closing parenthesis
    fields = stat.rsplit(")", 1)[1].split()
    state, start = fields[0], fields[19]
    return None if state in ("Z", "X") else start


def lost_message(lost: Mapping[int, str]) -> Optional[str]:
    """The verdict naming every lost rank (``{rank: why}``); None when there is none.

    One rank keeps the form ``rank K lost: why``; several are listed first, so the
    message says at once which ranks are gone: ``ranks K, L lost: rank K: why; rank L: why``.
    """
    if not lost:
        return None
    if len(lost) == 1:
        (r, why), = lost.items()
        return f"rank {r} lost: {why}"
    ranks = sorted(lost)
    return (f"ranks {', '.join(str(r) for r in ranks)} lost: "
            + "; ".join(f"rank {r}: {lost[r]}" for r in ranks))


def _process_identity() -> str:
    return f"{socket.gethostname()}|{os.getpid()}|{_proc_start_time(os.getpid()) or ''}"


@dataclass
class _Peer:
    counter: bytes = b""
    changed_at: float = 0.0
    host: str = ""
    pid: int = 0
    start: str = ""
    failed_since: Optional[float] = None
    failure: str = ""
    exited_ok: bool = False


class PeerWatchdog:
    """The heartbeat thread of one rank. Use :func:`install` rather than this class."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        interval_s: Optional[float] = None,
        failure_grace_s: Optional[float] = None,
        on_lost: Optional[Callable[[str], None]] = None,
    ) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank, self.world_size = rank, world_size
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, self.timeout_s / 5)
        self.failure_grace_s = failure_grace_s if failure_grace_s is not None else min(5.0, self.timeout_s)
        self.on_lost = on_lost or _exit_lost
        self._stop = threading.Event()
        self._counter = 0
        self._host = socket.gethostname()
        now = time.monotonic()
        self._peers: Dict[int, _Peer] = {r: _Peer(changed_at=now) for r in range(world_size) if r != rank}
        self._lost: Dict[int, str] = {}  # rank -> why, as first seen
        self._store_ok_at = now
        self.store.set(f"id/{rank}", _process_identity())
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"embrace-watchdog-rank{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ thread
    def _beat(self) -> None:
        self._counter += 1
        self.store.set(f"hb/{self.rank}", str(self._counter))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            verdict = self.check_once()
            if verdict is not None and not self._stop.is_set():
                verdict = self._settle(verdict)
                self._publish(verdict)
                self.on_lost(verdict)
                return

    def _settle(self, verdict: str) -> str:
        """One more round after this rank found a loss, to name the ranks lost with it.

        A machine that goes away takes all its ranks, but this rank may see them go a
        round apart: a kill lands between two reads of /proc, or the peers' last
        heartbeats were read in consecutive rounds. A peer silent for the timeout less
        one round is taken as lost with the others (a live peer beats every round)."""
        if not self._lost or self._stop.wait(self.interval_s):
            return verdict
        try:
            self._look_at_peers(time.monotonic(), slack_s=self.interval_s)
        except Exception:  # the store may be going away with the lost ranks
            pass
        return lost_message(self._lost) or verdict

    def _publish(self, verdict: str) -> None:
        """Tell the other survivors what was lost, then give them a moment to read it:
        this rank may host the store, which goes away with it."""
        if verdict.startswith(("rank ", "ranks ")) and "reported by rank" not in verdict:
            try:
                self.store.set("verdict", f"{verdict} (reported by rank {self.rank})")
                time.sleep(min(2 * self.interval_s, 2.0))
            except Exception:
                pass

    def check_once(self) -> Optional[str]:
        """One round: beat, look at every peer; the loss message, or None."""
        now = time.monotonic()
        try:
            self._beat()
            if self.store.check(["verdict"]):
                return self.store.get("verdict").decode()
            verdict = self._look_at_peers(now)
            self._store_ok_at = now
        except Exception as exc:  # store host gone, connection reset, ...
            silent = now - self._store_ok_at
            if silent >= self.timeout_s:
                return (
                    f"the rendezvous store has been unreachable for {silent:.1f} s "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): its host is lost "
                    "(rank 0 for tcp:// and env:// rendezvous without torchrun)"
                )
            return None
        return verdict

    def _look_at_peers(self, now: float, slack_s: float = 0.0) -> Optional[str]:
        """Look at every peer (all of them: a lost node takes several ranks); the verdict
        naming every rank lost so far, or None."""
        for r, peer in self._peers.items():
            if r in self._lost:
                continue
            why = self._look_at(r, peer, now, slack_s)
            if why is not None:
                self._lost[r] = why
        return lost_message(self._lost)

    def _look_at(self, r: int, peer: _Peer, now: float, slack_s: float) -> Optional[str]:
        """Why peer ``r`` is lost, or None."""
        if peer.exited_ok:
            return None
        if not peer.host and self.store.check([f"id/{r}"]):
            host, pid, start = self.store.get(f"id/{r}").decode().split("|")
            peer.host, peer.pid, peer.start = host, int(pid), start
        if peer.failed_since is None and self.store.check([f"exit/{r}"]):
            status = self.store.get(f"exit/{r}").decode()
            if status == "ok":
                peer.exited_ok = True
                return None
            peer.failed_since, peer.failure = now, status.split(": ", 1)[-1]
        if peer.failed_since is not None:
            if now - peer.failed_since >= self.failure_grace_s:
                return f"it failed ({peer.failure}) while this rank still runs"
            return None
        if self.store.check([f"hb/{r}"]):
            value = self.store.get(f"hb/{r}")
            if value != peer.counter:
                peer.counter, peer.changed_at = value, now
        if peer.host == self._host and peer.pid and _proc_start_time(peer.pid) != peer.start:
            # gone (or a zombie, or the pid reused); a clean exit publishes its status first
            if self.store.check([f"exit/{r}"]):
                return None  # read next round
            return f"its process {peer.pid} on {peer.host} is gone (killed or crashed)"
        silent = now - peer.changed_at
        if silent >= self.timeout_s - slack_s:
            return f"no heartbeat for {silent:.1f} s ({TIMEOUT_ENV}={self.timeout_s:g})"
        return None

    # ------------------------------------------------------------------ end
    def stop(self, ok: bool = True, reason: str = "") -> None:
        """Publish how this rank ends, stop watching and wait for the thread to end
        (at most :data:`JOIN_TIMEOUT_S`: see the module's doc for why). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(JOIN_TIMEOUT_S)
        status = "ok" if ok else f"failed: {reason}"[:500]
        try:
            self.store.set(f"exit/{self.rank}", status)
        except Exception:
            pass  # the store may already be gone at shutdown


def exit_lost(message: str) -> None:
    """The default action on a lost peer: log ``message`` and end the process."""
    _exit_lost(message)


def _exit_lost(message: str) -> None:
    # straight to stderr: logging may be configured to drop errors of non-master ranks
    text = f"[embrace watchdog] {message}; stopping this rank (exit {LOST_PEER_EXIT_CODE})"
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(LOST_PEER_EXIT_CODE)


_ACTIVE: Optional[PeerWatchdog] = None
_LOCK = threading.Lock()


def install(
    timeout_s: Optional[float] = None,
    *,
    store: Any = None,
    interval_s: Optional[float] = None,
    failure_grace_s: Optional[float] = None,
    on_lost: Optional[Callable[[str], None]] = None,
) -> Optional[PeerWatchdog]:
    """Start this rank's watchdog over the default process group's store (idempotent).

    Call it on every rank right after ``init_process_group``. ``timeout_s`` defaults to
    ``EMBRACE_PEER_TIMEOUT_S`` (60 s); 0 or a world of one installs nothing. An uncaught
    exception marks this rank failed and a normal interpreter exit marks it done, so
    peers tell a crash from the end of the job. ``on_lost(message)`` replaces the default
    action (log and ``os._exit(LOST_PEER_EXIT_CODE)``); it must end the process.
    """
    global _ACTIVE
    import torch.distributed as dist

    with _LOCK:
        if _ACTIVE is not None:
            return _ACTIVE
        if not (dist.is_available() and dist.is_initialized()):
            return None
        timeout = timeout_from_env() if timeout_s is None else float(timeout_s)
        world = dist.get_world_size()
        if timeout <= 0 or world < 2:
            return None
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        _ACTIVE = PeerWatchdog(store, dist.get_rank(), world, timeout, interval_s, failure_grace_s, on_lost)
        _chain_excepthook()
        atexit.register(stop)
        return _ACTIVE


def active() -> Optional[PeerWatchdog]:
    return _ACTIVE


def stop(ok: bool = True, reason: str = "") -> None:
    """Publish this rank's end (``ok`` or failed with ``reason``) and stop its watchdog."""
    global _ACTIVE
    wd = _ACTIVE
    if wd is not None:
        wd.stop(ok, reason)
        _ACTIVE = None


#: What gloo and c10d say when a peer's connection went away mid-collective.
_PEER_GONE_HINTS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "econnreset", "socket closed", "connection refused")


def looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether an exception is a collective failing because a peer disappeared."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return any(h in text for h in _PEER_GONE_HINTS)


def await_verdict(exc: BaseException) -> None:
    """When ``exc`` says a peer went away, give the watchdog the time to name it.

    gloo often notices a dead peer first, with an error naming only an address. The
    watchdog thread then ends the process with the rank's name within its timeout;
    this waits for that (returns if it finds nothing, e.g. the peer exited cleanly).
    """
    wd = _ACTIVE
    if wd is None or not looks_like_lost_peer(exc):
        return
    # detection, the settling round, the pause to publish, and a round of slack
    deadline = time.monotonic() + wd.timeout_s + 5 * wd.interval_s
    while time.monotonic() < deadline and wd._thread.is_alive():
        time.sleep(wd.interval_s / 2)


def _chain_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_embrace_watchdog", False):
        return

    def excepthook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        await_verdict(exc)
        first_line = (str(exc).splitlines() or [""])[0]
        stop(ok=False, reason=f"{exc_type.__name__}: {first_line}")
        previous(exc_type, exc, tb)

    excepthook._embrace_watchdog = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
