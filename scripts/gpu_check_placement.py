"""The ``device_placement`` check of ``scripts/gpu_check.py``: which GPU a rank's
collectives use when its model (sharded tables, whose construction runs collectives) is
built before anything set the device, as a model given to
``deepspeed_adapter.initialize`` is (:mod:`embrace_fairseq.core.cuda_device`).

Ranks are NCCL process groups in their own processes, started here (``run_ranks`` starts
gloo ranks). Parts:

* ``own_device``: a world of one: ``ensure_device`` keeps ``LOCAL_RANK``'s device, the GPU
  identity exchange runs through the real store, a CUDA tensor stays on its own device,
  a CPU tensor is staged on the current one;
* ``shared_gpu``: two ranks that both see only GPU 0 (``CUDA_VISIBLE_DEVICES=0``,
  ``LOCAL_RANK`` 0 and 1) build a sharded table: both stop with the one-line
  ``SharedGpuError`` naming the two ranks, before any NCCL communicator exists (no hang);
* ``local_rank_device`` (two GPUs or more): two ranks seeing every GPU, ``LOCAL_RANK`` 0
  and 1, nothing calls ``set_device``: building the table leaves each on its own GPU
  and the table's collectives give the replicated result.
"""
from __future__ import annotations

import os
import queue
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

PART_S = 30  # each multi-rank part: a hang shows as a timeout, not as a stuck check


def _rank_entry(fn: Callable[[int, int], Any], rank: int, world: int, store: str, env: Dict[str, str], out: Any,
                backend: str) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=PART_S))
        out.put((rank, "ok", fn(rank, world)))
    except Exception as exc:  # the error is the result for the refusal part
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _nccl_ranks(fn: Callable[[int, int], Any], envs: List[Dict[str, str]], backend: str = "nccl") -> List[Any]:
    """``fn(rank, world)`` on ``len(envs)`` NCCL ranks (``backend``), rank ``r`` with ``envs[r]`` set
    before torch sees a GPU; per rank ``("ok", result)`` or ``("error", message)``, or
    ``("lost", ...)`` for a rank that gave nothing within :data:`PART_S` seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA_VISIBLE_DEVICES must be set before the child's CUDA starts
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="embrace_placement_") as tmp:
        procs = [ctx.Process(target=_rank_entry, args=(fn, r, len(envs), os.path.join(tmp, "store"), env, q, backend), daemon=True)
                 for r, env in enumerate(envs)]
        for p in procs:
            p.start()
        got: Dict[int, Any] = {}
        try:
            while len(got) < len(procs):
                rank, kind, value = q.get(timeout=PART_S + 20)
                got[rank] = (kind, value)
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [got.get(r, ("lost", f"rank {r} gave no result within {PART_S + 20} s (a hang)")) for r in range(len(envs))]


def _env(local_rank: int, visible: str = None) -> Dict[str, str]:
    env = {"LOCAL_RANK": str(local_rank), "EMBRACE_FORCE_EXCHANGE": "1"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def build_table_rank(rank: int, world: int) -> Dict[str, Any]:
    """A sharded table built before anything set the device (its construction runs
    collectives), then a CPU tensor's and a CUDA tensor's all-reduce."""
    from embrace_fairseq import ShardedEmbedding
    from embrace_fairseq.core import collectives

    table = ShardedEmbedding(101, 8)  # CPU parameters; collectives staged on the current GPU
    full = table.full_weight()
    device = torch.cuda.current_device()
    cpu_sum = collectives.all_reduce(torch.ones(3)).tolist()
    on_gpu = torch.full((3,), float(rank + 1), device=torch.device("cuda", device))
    placed = collectives.device_for(None, on_gpu.device)
    collectives.all_reduce(on_gpu)
    return {"current_device": device, "full_rows": int(full.shape[0]), "cpu_sum": cpu_sum,
            "gpu_sum": on_gpu.cpu().tolist(), "placed": str(placed), "gpu_tensor_device": str(on_gpu.device)}


def own_device_rank(rank: int, world: int) -> Dict[str, Any]:
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.cuda_device import ensure_device, gpu_identity

    current = ensure_device()
    staged = collectives.device_for(None, "cpu")
    kept = collectives.device_for(None, torch.device("cuda", current))
    return {"current": current, "identity": gpu_identity(current), "staged": str(staged), "kept": str(kept),
            **build_table_rank(rank, world)}


def _expect(cond: bool, what: str, d: Dict[str, Any]) -> None:
    if not cond:
        raise AssertionError(f"{what}: {d}")


def device_placement(out: Path, cpu: bool) -> Dict[str, Any]:
    if cpu:
        return {"status": "skip", "detail": {
            "planned": ["own_device", "shared_gpu", "local_rank_device (two GPUs or more)"],
            "why": "NCCL needs GPUs; tests/core/test_cuda_device.py checks the choice and the refusal on CPU"}}
    d: Dict[str, Any] = {"gpus": torch.cuda.device_count()}
    [(kind, one)] = _nccl_ranks(own_device_rank, [_env(0)])
    d["own_device"] = one
    _expect(kind == "ok", "own_device", d)
    _expect(one["current"] == 0 and one["identity"].startswith("GPU-") and one["staged"] == "cuda:0"
            and one["kept"] == "cuda:0" and one["cpu_sum"] == [1.0] * 3 and one["full_rows"] == 101, "own_device", d)

    shared = _nccl_ranks(build_table_rank, [_env(0, "0"), _env(1, "0")])
    d["shared_gpu"] = shared
    for kind, message in shared:
        _expect(kind == "error" and message.startswith("SharedGpuError: ranks 0 and 1 both drive GPU-")
                and "\n" not in message, "shared_gpu: every rank stops with the one-line refusal", d)

    if d["gpus"] < 2:
        d["local_rank_device"] = "skipped: one GPU (needs two)"
    else:
        res = _nccl_ranks(build_table_rank, [_env(0), _env(1)])
        d["local_rank_device"] = res
        for r, (kind, got) in enumerate(res):
            _expect(kind == "ok" and got["current_device"] == r and got["gpu_tensor_device"] == f"cuda:{r}"
                    and got["placed"] == f"cuda:{r}" and got["cpu_sum"] == [2.0] * 3 and got["gpu_sum"] == [3.0] * 3,
                    "local_rank_device", d)
    return {"status": "pass", "detail": d}
