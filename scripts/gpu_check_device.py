"""Device checks of ``scripts/gpu_check.py`` added for the GPU-correctness review: what one GPU
can show of buffer lifetimes, the relaxed rows' stream, GPU-side timing and the native
kernels' paths. Each check is ``fn(out, cpu) -> {"status", "detail"}``; with ``cpu`` (the
``--cpu-smoke`` mode) it runs the same code on CPU/gloo where that means something and
says in its detail what only a GPU shows.

* ``lifetimes``: asynchronous collectives whose inputs the caller drops at once, while the
  collective's stream is kept busy by a large collective issued before and the caller's
  stream allocates and overwrites memory of the same size: the results must be the inputs'
  values (``collectives.Pending`` holds what a collective reads until the caller's stream
  is ordered after it). NCCL world of one, and two gloo processes whose tensors live on
  the one GPU.
* ``relaxed_overlap``: the relaxed rows on a non-default main stream: the background
  update runs on its own stream beside the next forward (CUDA events overlap) and the
  weights equal a CPU reference computed with plain ``F.embedding`` and the shard optimizer.
* ``timing``: a collective issued behind a known device delay: its end time (CUDA events,
  ``Pending.end_us``) lies after the delay and no later than the host's clock after it.
* ``native_paths``: each native kernel path forced: dense and sort dedup, 1024+ owners,
  fp16 rows scaled before rounding, a bad index raising ``RowIndexError`` with the CUDA
  context still usable afterwards.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

#: What each check proves only on a GPU (recorded in the CPU smoke's detail).
GPU_ONLY_PARTS = {
    "lifetimes": "allocator reuse across streams (CPU tensors have no stream)",
    "relaxed_overlap": "the side stream overlapping the next forward (CUDA events)",
    "timing": "device end times of a delayed collective (CUDA events)",
    "native_paths": "the CUDA kernels (the CPU run checks the CPU op and the reference at the same inputs)",
}


def _device(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


_CYCLES_PER_MS: Dict[str, float] = {}


def _delay(device: torch.device, ms: float) -> None:
    """Keep ``device``'s current stream busy for about ``ms`` milliseconds (a spin kernel,
    calibrated once with CUDA events); nothing on CPU."""
    if device.type != "cuda":
        return
    key = str(device)
    if key not in _CYCLES_PER_MS:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS[key] = 20_000_000 / max(a.elapsed_time(b), 1e-3)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[key]))


# --------------------------------------------------------------------------- lifetimes
def pressure_rounds(device: torch.device, group: Any, trials: int = 12, n: int = 1 << 18,
                    busy_numel: int = 1 << 26) -> Dict[str, int]:
    """Per kind of asynchronous collective: how many elements came out wrong when its
    input was dropped right after issue and its memory overwritten under it.

    On CUDA the collectives' stream is held back: a blocker collective is issued from a
    stream that first spins for 30 ms, so the collectives issued next from the main stream
    queue behind it, while the main stream (not delayed) goes on to allocate and overwrite
    memory at once. An input whose block went back to the main stream's pool is then
    overwritten before the collective reads it."""
    from embrace_fairseq.core import collectives

    world = collectives.world_size(group)
    me = collectives.rank(group)
    wrong = {"all_to_all_single_async": 0, "all_reduce_async": 0, "all_gather_async": 0}
    busy = torch.ones(busy_numel, device=device)  # a large blocker: keeps the collective's stream busy
    spin = torch.cuda.Stream(device) if device.type == "cuda" else None
    for t in range(trials):
        if spin is not None:
            spin.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(spin):
                _delay(device, 30.0)
                blocker = collectives.all_reduce_async(busy, group)  # the next ones queue behind it
        else:
            blocker = collectives.all_reduce_async(busy, group)
        a2a_out = torch.empty(n * world, device=device)
        x = torch.arange(n * world, dtype=torch.float32, device=device) + 1000 * t + me
        a2a = collectives.all_to_all_single_async(a2a_out, x, None, None, group)
        y = torch.full((n,), float(t + 1), device=device)
        red = collectives.all_reduce_async(y, group)
        z = torch.full((n,), float(me + 3 * t), device=device)
        gat = collectives.all_gather_async(z, group)
        del x, y, z  # nobody but the collectives holds the inputs now
        junk = [torch.full((n * world,), -7.0, device=device) for _ in range(6)]  # reuses freed blocks
        junk += [torch.full((n,), -9.0, device=device) for _ in range(6)]
        del junk
        blocker.wait()
        got_a2a = a2a.wait()
        got_red = red.wait()
        got_gat = gat.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # expected: rank r's block k of the AlltoAll is rank k's block r of its arange
        want = torch.cat([torch.arange(me * n, (me + 1) * n, dtype=torch.float32, device=device) + 1000 * t + k
                          for k in range(world)])
        wrong["all_to_all_single_async"] += int((got_a2a != want).sum())
        y_out = got_red if torch.is_tensor(got_red) else None
        if y_out is not None:
            wrong["all_reduce_async"] += int((y_out != float((t + 1) * world)).sum())
        parts = got_gat if isinstance(got_gat, (list, tuple)) else [got_gat]
        if len(parts) == world:
            for k, p in enumerate(parts):
                wrong["all_gather_async"] += int((p != float(k + 3 * t)).sum())
    return wrong


def lifetimes_rank(rank: int, world: int, device_name: str) -> Dict[str, int]:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return pressure_rounds(device, None, trials=6, n=1 << 16, busy_numel=1 << 24)


def lifetimes(out: Path, cpu: bool) -> Dict[str, Any]:
    import gpu_check_workers as W
    import torch.distributed as dist

    from embrace_fairseq.tools.local_ranks import run_ranks

    device = W.init_world_of_one(cpu)
    d: Dict[str, Any] = {"backend": dist.get_backend()}
    try:
        d["world_of_one"] = pressure_rounds(device, None)
    finally:
        dist.destroy_process_group()
    d["gloo_two_ranks"] = run_ranks(lifetimes_rank, 2, str(device), timeout_s=150)
    if cpu:
        d["gpu_only"] = GPU_ONLY_PARTS["lifetimes"]
    bad = {k: v for k, v in d["world_of_one"].items() if v} or [r for r in d["gloo_two_ranks"] if any(r.values())]
    return {"status": "fail" if bad else "pass", "detail": d}


# --------------------------------------------------------------------------- relaxed rows
def relaxed_overlap(out: Path, cpu: bool) -> Dict[str, Any]:
    """One relaxed step on a non-default main stream, then the next forward (its ids all in
    G, so it does not wait): the weights after the deferred update equal a CPU reference,
    and the side stream's events overlap the next forward's."""
    import gpu_check_workers as W
    import torch.distributed as dist

    from embrace_fairseq import ShardedEmbedding
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.relaxed_rows import RelaxedRows
    from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer

    device = W.init_world_of_one(cpu)
    d: Dict[str, Any] = {"backend": dist.get_backend()}
    vocab, dim = (200_000, 256) if not cpu else (2000, 16)
    try:
        torch.manual_seed(5)
        emb = ShardedEmbedding(vocab, dim, device=device)
        assert emb.is_sharded, "EMBRACE_FORCE_EXCHANGE=1 must put a world of one on the exchange"
        w0 = emb.weight.detach().cpu().clone()
        opt = ShardOptimizer([emb.weight], "adam")
        rr = RelaxedRows([emb], collectives.new_group())
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(0, vocab, (64, 256), generator=g)
        nxt = ids[:8].clone()  # the next batch reads a subset: no wait in its lookup
        coef = torch.randn(64, 256, dim, generator=g)
        proj = torch.randn(dim, 4096, generator=g)
        main = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(main) if main is not None else _null():
            out1 = emb(ids.to(device))
            rr.next_batch([[nxt.to(device)]])
            (out1 * coef.to(device)).sum().backward()
            rr.step(opt, HyperParams(lr=0.01))
            fwd = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if main else None
            if fwd:
                fwd[0].record(main)
            h = emb(nxt.to(device))
            p = proj.to(device)
            for _ in range(50):  # a forward with some work in it (a few ms on an H200)
                h = torch.tanh(h @ p) @ p.t() * 1e-3
            if fwd:
                fwd[1].record(main)
            rr.wait()  # the reader's stream waits for the side stream's last row write
            got = emb.weight.detach().cpu()
            out2 = h.detach().cpu()
        if main is not None:
            torch.cuda.synchronize(device)
            begin, end = rr.side_events
            ref_ev = fwd[0]
            side = (ref_ev.elapsed_time(begin), ref_ev.elapsed_time(end))
            forward = (0.0, ref_ev.elapsed_time(fwd[1]))
            d["side_ms"], d["forward_ms"] = side, forward
            d["overlap_ms"] = max(0.0, min(side[1], forward[1]) - max(side[0], forward[0]))
        # CPU reference: plain embedding, the same optimizer, one whole step
        w = w0.clone().requires_grad_()
        F.embedding(ids, w).mul(coef).sum().backward()
        ref_opt = ShardOptimizer([w], "adam")
        ref_opt.step(HyperParams(lr=0.01))
        d["weights_max_abs_diff"] = diff = float((got - w.detach()).abs().max())
        d["rows_moved"] = int(((w.detach() - w0).abs().sum(1) > 0).sum())
        assert torch.isfinite(out2).all()
    finally:
        dist.destroy_process_group()
    if cpu:
        d["gpu_only"] = GPU_ONLY_PARTS["relaxed_overlap"]
    ok = diff <= 1e-5 and d["rows_moved"] > 0 and (cpu or d["overlap_ms"] > 0.0)
    return {"status": "pass" if ok else "fail", "detail": d}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# --------------------------------------------------------------------------- timing
def timing(out: Path, cpu: bool) -> Dict[str, Any]:
    """An all-reduce issued behind ~50 ms of device work: its device times
    (``Pending.issued_us``, the start event, and ``end_us``, on the host clock through the
    anchor event) lie at least the delay after the host issued it (they time execution,
    not enqueueing), start before end, and end no later than the host's clock once it is
    known to be finished."""
    import gpu_check_workers as W
    import torch.distributed as dist

    from embrace_fairseq.core import collectives

    device = W.init_world_of_one(cpu)
    d: Dict[str, Any] = {"backend": dist.get_backend()}
    delay_ms = 50.0
    rows: List[Dict[str, float]] = []
    try:
        x = torch.ones(1 << 20, device=device)
        collectives.all_reduce(x)  # warm
        for _ in range(3):
            _delay(device, delay_ms)
            p = collectives.all_reduce_async(x)
            issue_host = getattr(p, "host_issued_us", None)
            p.synchronize()
            after_host = time.perf_counter() * 1e6
            start, end = p.issued_us, p.end_us()
            issue_host = start if issue_host is None else issue_host
            rows.append({"start_minus_host_issue_ms": (start - issue_host) / 1e3,
                         "end_minus_start_ms": (end - start) / 1e3,
                         "host_after_minus_end_ms": (after_host - end) / 1e3})
            p.wait()
    finally:
        dist.destroy_process_group()
    d["rounds"] = rows
    slack_ms = 2.0  # the anchor's placement on the host clock
    ok = all(r["host_after_minus_end_ms"] >= -slack_ms and r["end_minus_start_ms"] >= -slack_ms for r in rows)
    if not cpu:
        ok = ok and all(r["start_minus_host_issue_ms"] >= 0.8 * delay_ms for r in rows)
    else:
        d["gpu_only"] = GPU_ONLY_PARTS["timing"]
    return {"status": "pass" if ok else "fail", "detail": d}


# --------------------------------------------------------------------------- native kernels
def native_paths(out: Path, cpu: bool) -> Dict[str, Any]:
    from embrace_fairseq import InvalidIdError, ShardPlan
    from embrace_fairseq.core import native_ops as N

    mod = N.native_module()
    if mod is None:
        return {"status": "skip", "detail": N.native_status()}
    device = _device(cpu)
    if device.type == "cuda" and not mod.WITH_CUDA:
        return {"status": "skip", "detail": "the extension was built without CUDA kernels"}
    d: Dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    # dense / sort / auto at small and 1024+ worlds, and sparse ids of a large vocabulary
    cases = [(50_000, 4, torch.randint(0, 50_000, (4096,), generator=g)),
             (7 * 1500 + 3, 1500, torch.randint(0, 7 * 1500 + 3, (5000,), generator=g)),
             (7 * 4096, 4096, torch.randint(0, 7 * 4096, (20000,), generator=g)),
             (2**31 - 2, 8, torch.tensor([3, 2**30 + 11, 3, 2**31 - 3]))]
    for vocab, world, ids in cases:
        bounds = ShardPlan(vocab, world).boundaries
        ref = N.dedup_bucket_reference(ids, bounds)
        for method in (0, 1, 2):
            got = N.dedup_bucket_native(ids.to(device), bounds, method)
            assert got.send_counts == ref.send_counts, (vocab, world, method)
            assert torch.equal(got.unique_ids.cpu(), ref.unique_ids), (vocab, world, method)
            assert torch.equal(got.inverse.cpu(), ref.inverse), (vocab, world, method)
        d[f"dedup_world{world}"] = "dense, sort and auto equal the reference"
    # fp16 rows scaled before their rounding (4 ranks' 40000 average to 40000)
    src = torch.full((4, 8), 40000.0, dtype=torch.float16)
    idx = torch.zeros(4, dtype=torch.long)
    have = N.scatter_add_rows_native(src.to(device), idx.to(device), 2, 0.25).cpu()
    assert torch.equal(have, N.scatter_add_rows_reference(src, idx, 2, 0.25)) and bool((have[0] == 40000).all())
    d["fp16_scaled_before_rounding"] = True
    # a bad index: the package's error on the host, the context still usable
    table = torch.randn(5, 3, device=device)
    for fn, args, msg in ((N.gather_rows_native, (table, torch.tensor([0, 7], device=device)),
                           "gather_rows: index 7 out of range for a table of 5 rows"),
                          (N.scatter_add_rows_native, (table, torch.tensor([0, 9, 1, 2, 3], device=device), 5),
                           "scatter_add_rows: index 9 out of range for 5 rows")):
        try:
            fn(*args)
        except N.RowIndexError as exc:
            assert isinstance(exc, InvalidIdError) and str(exc) == msg, str(exc)
        else:
            raise AssertionError(f"{fn.__name__} accepted a bad index")
    alive = float(torch.ones(1000, device=device).sum())  # a kernel and a copy after the error
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    d["context_alive_after_bad_index"] = alive == 1000.0
    if cpu:
        d["gpu_only"] = GPU_ONLY_PARTS["native_paths"]
    return {"status": "pass" if d["context_alive_after_bad_index"] else "fail", "detail": d}
