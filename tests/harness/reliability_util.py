"""Shared by the reliability tests: what each scenario reports to ``docs/RELIABILITY.md``.

A test calls :func:`note` with pytest's ``record_property``; the report plugin in
``embrace_fairseq.tools.fault_report`` reads the properties back from the test reports.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterable, Optional

import psutil


def note(record_property: Callable, path: str, outcome: str, detect_s: Optional[float] = None) -> None:
    record_property("path", path)
    record_property("outcome", outcome)
    if detect_s is not None:
        record_property("detect_s", round(float(detect_s), 2))


def leftover_processes(pids: Iterable[int]) -> list:
    """The given processes (or their children) still alive (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            try:
                if q.status() != psutil.STATUS_ZOMBIE:
                    alive.append((q.pid, " ".join(q.cmdline())[:120]))
            except psutil.NoSuchProcess:
                pass
    return alive


def wait_for(predicate: Callable[[], bool], timeout: float, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def children_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, like a machine that goes away."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
