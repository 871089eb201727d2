"""The benchmark's launcher stops its ranks before the machine runs out of memory, and names
the rank that failed first.

Real rank processes (the bench's own worker) on loopback, started by the launcher itself:
a reserve above the machine's memory makes the guard fire at its first look; a rank killed
from outside, as the kernel's OOM killer kills one, must be the one the error names. Every
rank is gone when the error comes back.
"""
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import List

import pytest

from embrace_fairseq.perf.bench import __main__ as bench
from embrace_fairseq.perf.bench import memory_guard as MG
from embrace_fairseq.perf.bench import netem_cluster as NC


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _launch(tmp_path: Path, monkeypatch, reserve_gb: float, started: List[int]) -> str:
    """One launch of 2 ranks of the translation workload; the error it ends with. ``started``
    gets the ranks' pids as the launcher starts them."""
    a = bench.parse_args(["--quick", "--loopback", "--models", "translation", "--worlds", "2",
                          "--memory-reserve-gb", str(reserve_gb), "--timeout", "120", "--out", str(tmp_path / "out")])
    a.cache, a.allocator_env = tmp_path / "cache", {}
    (tmp_path / "logs").mkdir()
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):  # the real Popen, its pid kept for the test
        proc = real_popen(*args, **kwargs)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    cluster = NC.Cluster.create(2, NC.LinkSpec(1.0, 0.0), loopback=True)
    try:
        with pytest.raises(RuntimeError) as err:
            bench._launch(a, "translation", cluster, [NC.LinkSpec(1.0, 0.0)], tmp_path, tmp_path / "logs")
    finally:
        cluster.close()
    return str(err.value)


def test_ranks_stopped_when_memory_falls_below_the_reserve(tmp_path, monkeypatch):
    _, total = MG.machine_memory()
    reserve = round(2 * total / 1e9)  # more than the machine has: the guard fires at its first look
    pids: List[int] = []
    t0 = time.monotonic()
    message = _launch(tmp_path, monkeypatch, reserve, pids)
    assert time.monotonic() - t0 < 30
    assert message.startswith("translation on 2 ranks: stopped every rank, the machine's available memory fell to")
    assert f"(reserve {reserve:g} GB; ranks held " in message and "needs more memory" in message
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_the_rank_killed_first_is_named(tmp_path, monkeypatch):
    """Rank 1 killed by SIGKILL while both start up: the error is rank 1's, with its signal,
    not rank 0's, which the launcher stopped after it."""
    pids: List[int] = []
    messages: List[str] = []
    run = threading.Thread(target=lambda: messages.append(_launch(tmp_path, monkeypatch, 0, pids)))
    run.start()
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2, "the launcher did not start the ranks"
    time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)
    run.join(timeout=60)
    assert not run.is_alive() and messages
    assert messages[0].startswith("translation rank 1 of 2 failed: no result file: killed by SIGKILL"), messages[0][:300]
    assert not any(_alive(p) for p in pids)


def test_exit_statuses_in_words():
    assert "OOM killer" in bench._no_result(-signal.SIGKILL)
    assert bench._no_result(-signal.SIGTERM) == "no result file: killed by SIGTERM"
    assert bench._no_result(2) == "no result file: exit status 2"
