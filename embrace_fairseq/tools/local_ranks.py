"""Start N real ``torch.distributed`` ranks (gloo) as processes on this machine.

Used by the tests, the demonstration and the benchmarks: each rank is a process of
its own, joined through a file store, so collectives are the real thing. Any rank
failing, or the whole run exceeding its time budget, fails the call with every rank's
error; no process is left behind.

The ranks are forked from multiprocessing's fork server, which imports torch (and fairseq
with a CPU-only torch) once, before its first fork (:func:`preload`): a spawned
interpreter spends about 2 s of CPU importing torch and 4 s with fairseq, for every rank of
every call, which on 2 cores was most of the test suite's time. No rank is forked from the
caller, whose threads (and, on a GPU machine, CUDA context) a fork must not copy.

multiprocessing gives a fork server child the caller's working folder and ``sys.path``,
but the environment and standard streams of the server, which started at the first call;
each rank therefore takes the caller's at the call (:class:`_CallerState`), as a spawned
one would. What a process reads only as it starts (``LD_PRELOAD``, glibc's ``MALLOC_*``)
is the server's: a rank that needs such a setting makes it itself (``mallopt``), or the
caller starts its own processes.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, List

import torch

from embrace_fairseq.core.process_group import free_port  # noqa: F401  (re-exported for callers)


def preload() -> List[str]:
    """The modules the fork server imports before its first fork (one that fails to import
    is skipped there and imported by the rank that needs it). fairseq only with a torch
    built without CUDA: importing it asks torch, and DeepSpeed, for the CUDA devices, which
    initialises the CUDA driver, and a child forked after that cannot use CUDA."""
    modules = ["torch", "torch.distributed", __name__]
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        modules.append("fairseq")
    return modules


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out."""


def _adopt(environ: Dict[str, str], out: Any, err: Any) -> None:  # pragma: no cover - child
    os.environ.clear()
    os.environ.update(environ)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


class _CallerState:
    """The caller's environment and file descriptors 1 and 2, taken over by the rank as
    this object is unpickled there. It is the first of the rank's arguments, so it is
    unpickled before ``fn``, whose module may read the environment at import;
    multiprocessing hands the descriptors to the fork server's child as it does a Queue's
    pipes."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt, (self.environ, reduction.DupFd(1), reduction.DupFd(2))


def _rank_main(adopted, fn, rank, world, store_path, pg_timeout_s, result_q, args, kwargs):  # pragma: no cover - child
    # ``adopted`` is None: the caller's state was taken over as it was unpickled (_CallerState)
    import torch.distributed as dist

    from embrace_fairseq.guards import watchdog

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        # a peer that dies or hangs stops this rank too (EMBRACE_PEER_TIMEOUT_S)
        watchdog.install(on_lost=lambda msg: _report_lost(rank, result_q, msg))
        out = fn(rank, world, *args, **kwargs)
        watchdog.stop(ok=True)
        result_q.put((rank, True, out))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        watchdog.await_verdict(exc)  # a peer gone: let the watchdog name it
        watchdog.stop(ok=False, reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        result_q.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _report_lost(rank, result_q, message):  # pragma: no cover - child, watchdog thread
    from embrace_fairseq.guards import watchdog

    try:
        result_q.put((rank, False, f"PeerLost: {message}"))
        result_q.close()
        result_q.join_thread()
    finally:
        watchdog.exit_lost(message)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    return_errors: bool = False,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the per-rank results in rank order. ``fn`` must be importable (a module
    level function) and its result picklable. With ``return_errors=True`` a failed
    rank's entry is an ``RanksFailed`` holding its traceback instead of raising.
    Each rank sees the environment, working folder, ``sys.path`` and standard streams the
    caller has now.

    >>> from embrace_fairseq.tools import local_ranks
    >>> local_ranks.run_ranks(local_ranks.world_of, 2)
    [2, 2]
    """
    ctx = _context()
    caller = _CallerState()
    result_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="embrace_ranks_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(caller, fn, r, world_size, store, pg_timeout_s, result_q, args, kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict = {}
        deadline = _now() + timeout_s
        try:
            while len(results) < world_size:
                remaining = deadline - _now()
                if remaining <= 0:
                    break
                try:
                    rank, ok, out = result_q.get(timeout=min(remaining, 1.0))
                    results[rank] = (ok, out)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                    if dead and all(not p.is_alive() for p in procs):
                        break
        finally:
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                p._embrace_killed = p.is_alive()
                if p._embrace_killed:
                    p.kill()
                    p.join()
    missing = [r for r in range(world_size) if r not in results]
    errors = {r: out for r, (ok, out) in results.items() if not ok}
    if return_errors:
        return [
            RanksFailed(results[r][1]) if r in errors else (results[r][1] if r in results else RanksFailed(_no_result(procs[r], timeout_s)))
            for r in range(world_size)
        ]
    if errors or missing:
        lines = [f"rank {r}: {msg}" for r, msg in sorted(errors.items())]
        lines += [f"rank {r}: {_no_result(procs[r], timeout_s)}" for r in missing]
        raise RanksFailed("\n".join(lines))
    return [results[r][1] for r in range(world_size)]


def world_of(rank: int, world: int) -> int:
    """The world size a rank was started in, after a barrier (a rank function for examples)."""
    import torch.distributed as dist

    dist.barrier()
    return dist.get_world_size()


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    # takes effect when the server starts (the first call); later calls reuse it
    ctx.set_forkserver_preload(preload())
    return ctx


def _no_result(proc: Any, timeout_s: float) -> str:
    from embrace_fairseq.guards.watchdog import LOST_PEER_EXIT_CODE

    code = proc.exitcode
    if code is None or code == -9 and proc._embrace_killed:
        return f"no result within {timeout_s:.0f}s (hung; killed)"
    if code == LOST_PEER_EXIT_CODE:
        return f"stopped by its watchdog (exit {code}): a peer was lost, see the log"
    if code < 0:
        return f"died from signal {-code} without a result"
    return f"exited with code {code} without a result"


def _now() -> float:
    import time

    return time.monotonic()
