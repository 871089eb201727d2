"""Start N real ``torch.distributed`` ranks (gloo) as processes on this machine.

Used by the tests, the demonstration and the benchmarks: each rank is a spawned
process with its own interpreter, joined through a file store, so collectives are
the real thing. Any rank failing, or the whole run exceeding its time budget, fails
the call with every rank's error; no process is left behind.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, List

import torch

from embrace_fairseq.core.process_group import free_port  # noqa: F401  (re-exported for callers)


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out."""


def _rank_main(fn, rank, world, store_path, pg_timeout_s, result_q, args, kwargs):  # pragma: no cover - child
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
    """
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="embrace_ranks_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, store, pg_timeout_s, result_q, args, kwargs),
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
