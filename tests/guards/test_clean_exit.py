"""clean_exit: the process group is destroyed at exit, and the exit stays bounded when the
destroy cannot finish. Real gloo groups in real processes (the handler runs at interpreter
exit, so each case is its own Python)."""
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", **env))


def test_the_group_is_destroyed_at_exit_with_work_in_flight():
    # a handler registered before install() runs after clean_exit's (atexit is LIFO): it sees
    # whether the group was destroyed before the interpreter finalizes
    proc = _python("""
        import atexit, torch, torch.distributed as dist
        atexit.register(lambda: print("initialized at the end:", dist.is_initialized(), flush=True))
        from embrace_fairseq.guards import clean_exit
        clean_exit.install(timeout_s=20)
        dist.init_process_group("gloo", rank=0, world_size=1)
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)  # left without wait()
        print("trained", flush=True)
    """, MASTER_PORT=str(_free_port()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "trained" in out and "initialized at the end: False" in out, out


def test_an_exit_with_a_pending_collective_is_bounded():
    # rank 1 leaves while its all-reduce can never complete (rank 0 stays up and never joins
    # it; the group's own timeout is 10 min): gloo's destructor would wait for it, clean_exit
    # gives up after its timeout and the process ends
    port = str(_free_port())
    peer = _python("""
        import time, torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=2)
        print("up", flush=True)
        time.sleep(300)
    """, MASTER_PORT=port)
    try:
        leaver = _python("""
            import datetime, torch, torch.distributed as dist
            from embrace_fairseq.guards import clean_exit
            clean_exit.install(timeout_s=2)
            dist.init_process_group("gloo", rank=1, world_size=2, timeout=datetime.timedelta(minutes=10))
            work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 0 never joins it
            print("leaving", flush=True)
        """, MASTER_PORT=port)
        try:
            out, _ = leaver.communicate(timeout=90)  # start-up included; without the bound: 10 min
        except subprocess.TimeoutExpired:
            leaver.kill()
            pytest.fail("the rank's exit waited for a collective that never completes: " + leaver.communicate()[0])
        assert "leaving" in out, out
    finally:
        peer.kill()
        peer.communicate()
