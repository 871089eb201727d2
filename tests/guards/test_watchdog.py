"""watchdog: unit tests of PeerWatchdog over an in-memory store, small timeouts, peers
played by this test (heartbeat keys written by hand, real processes for pids)."""
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from embrace_fairseq.guards import watchdog as W

P = W._PREFIX


class Peers:
    """Rank ``r`` of the test's making: beats, publishes its identity, exits."""

    def __init__(self, store):
        self.store = dist.PrefixStore(P, store)  # the keys as the watchdog sees them

    def beat(self, r, n):
        self.store.set(f"hb/{r}", str(n))

    def identity(self, r, pid, host=None):
        host = host or __import__("socket").gethostname()
        self.store.set(f"id/{r}", f"{host}|{pid}|{W._proc_start_time(pid) or 'gone'}")

    def exit(self, r, status):
        self.store.set(f"exit/{r}", status)


def manual(world=3, timeout=0.5, grace=0.3):
    """A watchdog of rank 0 whose thread never runs a round by itself (huge interval):
    the test calls check_once()."""
    store = dist.HashStore()
    lost = []
    wd = W.PeerWatchdog(store, 0, world, timeout_s=timeout, interval_s=3600, failure_grace_s=grace,
                        on_lost=lost.append)
    return wd, Peers(store), lost


def test_beating_peers_are_not_lost_and_a_silent_one_is_named_after_the_timeout():
    wd, peers, _ = manual(timeout=0.4)
    try:
        for n in range(6):
            peers.beat(1, n)
            peers.beat(2, n)
            assert wd.check_once() is None  # sees both counters move
            t_last = time.monotonic()
            time.sleep(0.1)
        for n in range(6, 20):  # rank 1 goes on; rank 2 stops beating (hung)
            peers.beat(1, n)
            verdict = wd.check_once()
            if verdict:
                break
            time.sleep(0.05)
        took = time.monotonic() - t_last
        assert verdict is not None and verdict.startswith("rank 2 lost: no heartbeat for"), verdict
        assert "EMBRACE_PEER_TIMEOUT_S=0.4" in verdict
        assert 0.35 <= took < 0.4 + 1.0, took  # not before the timeout; within a round more (loaded machine)
    finally:
        wd.stop()


def test_killed_peer_process_is_seen_at_once():
    wd, peers, _ = manual(timeout=30)  # long timeout: the pid check, not the heartbeat, must find it
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peers.identity(1, proc.pid)
        peers.identity(2, wd_pid := __import__("os").getpid())  # rank 2 is this (live) process
        peers.beat(1, 1)
        peers.beat(2, 1)
        assert wd.check_once() is None
        proc.kill()
        proc.wait()
        verdict = wd.check_once()
        assert verdict == f"rank 1 lost: its process {proc.pid} on {wd._host} is gone (killed or crashed)", verdict
        assert str(wd_pid) not in verdict
    finally:
        proc.kill()
        wd.stop()


def test_every_lost_rank_is_named():
    """Two peers killed (a node gone): one verdict lists both, each with its reason."""
    wd, peers, _ = manual(world=4, timeout=30)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        for r, proc in zip((1, 2), procs):
            peers.identity(r, proc.pid)
        peers.identity(3, __import__("os").getpid())  # rank 3 is this (live) process
        for r in (1, 2, 3):
            peers.beat(r, 1)
        assert wd.check_once() is None
        for proc in procs:
            proc.kill()
            proc.wait()
        verdict = wd.check_once()
        gone = [f"rank {r}: its process {p.pid} on {wd._host} is gone (killed or crashed)" for r, p in zip((1, 2), procs)]
        assert verdict == "ranks 1, 2 lost: " + "; ".join(gone), verdict
        assert W.lost_message({4: "why"}) == "rank 4 lost: why" and W.lost_message({}) is None
    finally:
        for proc in procs:
            proc.kill()
        wd.stop()


def test_thread_names_ranks_that_went_silent_a_round_apart():
    """Ranks 2 and 3 stop beating one round apart (their node went away between two reads):
    the settling round after the first loss names both; rank 1, beating, is not named."""
    store = dist.HashStore()
    peers, called = Peers(store), []
    done, stop = threading.Event(), threading.Event()
    stopped = {}

    def beat():
        n, t0 = 0, time.monotonic()
        while not stop.is_set():
            n += 1
            for r in (1, 2, 3):
                if r == 1 or time.monotonic() - t0 < (0.6 if r == 2 else 0.7):
                    peers.beat(r, n)
                else:
                    stopped.setdefault(r, time.monotonic())
            time.sleep(0.01)

    threading.Thread(target=beat, daemon=True).start()
    wd = W.PeerWatchdog(store, 0, 4, timeout_s=0.5, interval_s=0.1,
                        on_lost=lambda msg: (called.append(msg), done.set()))
    try:
        assert done.wait(5.0), "the watchdog never reported the silent ranks"
        msg = called[0]
        assert msg.startswith("ranks 2, 3 lost: rank 2: no heartbeat for"), msg
        assert "; rank 3: no heartbeat for" in msg and "rank 1" not in msg, msg
    finally:
        stop.set()
        wd.stop()


def test_clean_exit_is_not_a_loss_and_a_failure_is_reported_after_the_grace():
    wd, peers, _ = manual(timeout=0.3, grace=0.2)
    try:
        peers.exit(1, "ok")
        peers.beat(2, 1)
        peers.exit(2, "failed: InvalidIdError: embedding id 99 is out of range")
        assert wd.check_once() is None  # within the grace the failed rank may still be joined
        time.sleep(0.5)  # rank 1 silent longer than the timeout, yet it ended cleanly
        verdict = wd.check_once()
        assert verdict == ("rank 2 lost: it failed (InvalidIdError: embedding id 99 is out of range) "
                           "while this rank still runs"), verdict
    finally:
        wd.stop()


def test_verdict_of_another_rank_is_taken_over():
    wd, peers, _ = manual()
    try:
        peers.beat(1, 1)
        peers.beat(2, 1)
        wd.store.set("verdict", "rank 2 lost: no heartbeat for 9.0 s (reported by rank 1)")
        assert wd.check_once() == "rank 2 lost: no heartbeat for 9.0 s (reported by rank 1)"
    finally:
        wd.stop()


def test_unreachable_store_counts_as_a_loss_after_the_timeout():
    wd, peers, _ = manual(timeout=0.3)

    class Gone:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise ConnectionResetError("Connection reset by peer")
            return fail

    try:
        peers.beat(1, 1)
        peers.beat(2, 1)
        assert wd.check_once() is None
        wd.store = Gone()
        assert wd.check_once() is None  # a blip is not a loss
        time.sleep(0.35)
        verdict = wd.check_once()
        assert verdict is not None and verdict.startswith("the rendezvous store has been unreachable for"), verdict
        assert "ConnectionResetError" in verdict and "its host is lost" in verdict
    finally:
        wd.store = dist.PrefixStore(P, dist.HashStore())
        wd.stop()


def test_thread_detects_a_hung_peer_within_the_bound():
    """The real thread, small timeout: on_lost is called once, naming the peer, in bounded time."""
    store = dist.HashStore()
    peers, called = Peers(store), []
    done = threading.Event()
    stop_beating = threading.Event()

    def beat_rank_1():
        n = 0
        while not stop_beating.is_set():
            n += 1
            peers.beat(1, n)
            time.sleep(0.02)

    threading.Thread(target=beat_rank_1, daemon=True).start()
    t0 = time.monotonic()
    wd = W.PeerWatchdog(store, 0, 3, timeout_s=0.5, interval_s=0.05,
                        on_lost=lambda msg: (called.append((msg, time.monotonic())), done.set()))
    try:
        assert done.wait(5.0), "the watchdog never reported the silent rank 2"
        msg, at = called[0]
        assert msg.startswith("rank 2 lost: no heartbeat for"), msg
        # timeout + one interval + the 2-interval pause to publish the verdict, plus slack for a loaded machine
        assert 0.5 <= at - t0 < 0.5 + 3 * 0.05 + 1.0, at - t0
        assert peers.store.get("verdict").decode() == msg + " (reported by rank 0)"
        time.sleep(0.2)
        assert len(called) == 1  # the thread stops after a verdict
    finally:
        stop_beating.set()
        wd.stop()
    assert peers.store.get("exit/0") == b"ok"


def test_timeout_from_env(monkeypatch):
    monkeypatch.delenv(W.TIMEOUT_ENV, raising=False)
    assert W.timeout_from_env() == W.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(W.TIMEOUT_ENV, "2.5")
    assert W.timeout_from_env() == 2.5
    for bad, match in (("soon", "not a number"), ("-1", "must be >= 0")):
        monkeypatch.setenv(W.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=match):
            W.timeout_from_env()


def test_lost_peer_errors_are_recognised():
    assert W.looks_like_lost_peer(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"))
    assert not W.looks_like_lost_peer(ValueError("embedding id 5 is out of range"))


_EXIT_MID_ROUND = r"""
import atexit, datetime, time
import torch.distributed as dist
from embrace_fairseq.guards import watchdog as W
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
# rounds back to back: the thread is inside a store call (the GIL released) nearly always
wd = W.PeerWatchdog(store, 0, 2, timeout_s=60, interval_s=1e-4, on_lost=print)
atexit.register(wd.stop)
time.sleep(0.2)
"""


def test_exit_while_the_thread_is_mid_round_is_clean():
    """The interpreter ending while the watchdog's thread is inside a store call killed
    the process (``terminate called without an active exception``, exit 134, after a
    complete run): stop() at exit now joins the thread first. Rounds run back to back
    here; without the join nearly every run aborts."""
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _EXIT_MID_ROUND], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "terminate called" not in out.stderr, (out.returncode, out.stderr[-2000:])
