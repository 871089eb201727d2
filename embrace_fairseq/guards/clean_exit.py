"""Destroy the default process group at exit, while the interpreter is still whole.

fairseq's ``distributed_main`` (so ``fairseq-train``) never calls
``torch.distributed.destroy_process_group()``. The gloo process group's C++ worker
threads then live on into the interpreter's finalization, and a rank that finished
training can die there with ``terminate called without an active exception`` (exit
code 134 after a complete run: seen rarely in 2- and 3-rank ``fairseq-train`` runs, the
plugin loaded). :func:`install` registers an ``atexit`` handler that destroys the group
first, which joins those threads while Python can still run their clean-up.

The destroy is bounded: a rank leaving with a collective still pending (an error on its
way out, a peer gone) would wait in the group's destructor for peers that never come, so
it runs on a daemon thread and the exit goes on after ``timeout_s`` whatever it did.

>>> install(); install()  # idempotent: one handler however often the plugin is imported
>>> destroy_at_exit(1.0)  # no group: nothing to do
False
"""
from __future__ import annotations

import atexit
import threading

#: seconds the exit waits for the group's destructor before it goes on regardless
DEFAULT_TIMEOUT_S = 5.0

_installed = False


def destroy_at_exit(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Destroy the default process group if one is up, waiting at most ``timeout_s``;
    true when it was destroyed in time."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    worker = threading.Thread(target=dist.destroy_process_group, name="embrace-destroy-process-group", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()


def install(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Register :func:`destroy_at_exit` once. Handlers registered later (the watchdog's
    stop, the schedule's close) run before it: ``atexit`` runs them last-in first-out."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(destroy_at_exit, timeout_s)
