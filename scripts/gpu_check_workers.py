"""Bodies of the ``scripts/gpu_check.py`` checks that run in this process: the exchange on a
world-of-one group (NCCL on GPU, gloo with ``--cpu-smoke``) and the native kernels. The
training checks are in :mod:`gpu_check_train`."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F


def workers() -> Dict[str, Callable[[Path, bool], Dict[str, Any]]]:
    """Every check's body, by name (``scripts/gpu_check.py`` lists the same names)."""
    import gpu_check_clock as C
    import gpu_check_device as G
    import gpu_check_placement as P
    import gpu_check_train as T

    return {"exchange": exchange, "native": native, "native_paths": G.native_paths, "lifetimes": G.lifetimes,
            "relaxed_overlap": G.relaxed_overlap, "timing": G.timing,
            "device_placement": P.device_placement, "vocab_parallel": vocab_parallel,
            "deepspeed": T.deepspeed_vs_stock, "deepspeed_fp16_skip": T.deepspeed_fp16_skip,
            "fairseq": T.fairseq_vs_stock, "fairseq_resume": T.fairseq_resume, "one_clock": C.one_clock}


def run_worker(name: str, out: Path, cpu: bool) -> Dict[str, Any]:
    bodies = workers()
    if not cpu and not torch.cuda.is_available():
        return {"status": "fail", "detail": "no CUDA device: run with --cpu-smoke on machines without a GPU"}
    try:
        return bodies[name](out, cpu)
    except Exception as exc:  # reported in the JSON, with the log beside it
        import traceback

        return {"status": "fail", "detail": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world_of_one(cpu: bool) -> torch.device:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    if cpu:
        dist.init_process_group("gloo", rank=0, world_size=1)
        return torch.device("cpu")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return torch.device("cuda", 0)


def _close(d: Dict[str, Any], key: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    d[key] = err
    if not err <= tol:
        raise AssertionError(f"{key}: difference {err} above {tol}")


def _lookup(dtype: torch.dtype, device: torch.device, d: Dict[str, Any]) -> None:
    """Forward and backward through the exchange vs F.embedding (fp32 gradient sums)."""
    from embrace_fairseq import ShardedEmbedding
    from embrace_fairseq.optim.grad_norm import nonfinite_gradients, sharded_sq_norm

    torch.manual_seed(0)
    emb = ShardedEmbedding(1000, 64, padding_idx=1, dtype=dtype, device=device)
    assert emb.is_sharded, "EMBRACE_FORCE_EXCHANGE=1 must put a world of one on the exchange"
    ids = torch.randint(0, 1000, (32, 40), device=device)
    ids[0, :5] = 1
    ref_w = emb.weight.detach().float().clone().requires_grad_()
    out = emb(ids)
    ref = F.embedding(ids, ref_w, padding_idx=1)
    _close(d, f"forward_{dtype}", out, ref, 0.0)
    coef = torch.randn(*ids.shape, 64, device=device)
    (out.float() * coef).sum().backward()
    (ref * coef).sum().backward()
    tol = 0.0 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 3e-3) * float(ref_w.grad.abs().max())
    _close(d, f"grad_{dtype}", emb.weight.grad, ref_w.grad, max(tol, 1e-5))
    norm = sharded_sq_norm([emb.weight.grad])
    assert norm.device == emb.weight.device and not nonfinite_gradients([("w", emb.weight.grad)])
    full = emb.gathered_weight()
    (full.float() * 2).sum().backward()
    _close(d, f"full_table_{dtype}", emb.full_weight(), emb.weight, 0.0)


def _guards(device: torch.device, d: Dict[str, Any]) -> None:
    from embrace_fairseq.core.agreement import check_agreement
    from embrace_fairseq.guards.replica_check import check_replicas_agree

    module = torch.nn.Linear(4, 4).to(device)
    check_agreement({"a": 1, "b": 2}, "the check", "")  # CPU integers on the group's device
    d["replica_digests"] = len(check_replicas_agree(module))


def _relaxed(device: torch.device, d: Dict[str, Any]) -> None:
    """One relaxed step (deferred rows on their own group) equals a synchronous one."""
    from embrace_fairseq import ShardedEmbedding
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.relaxed_rows import RelaxedRows
    from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer

    weights = []
    for relaxed in (False, True):
        torch.manual_seed(1)
        emb = ShardedEmbedding(500, 16, device=device)
        opt = ShardOptimizer([emb.weight], "adam")
        rr = RelaxedRows([emb], collectives.new_group()) if relaxed else None
        ids = torch.randint(0, 500, (8, 10), device=device)
        out = emb(ids)
        if rr is not None:
            rr.next_batch([[ids[:4]]])  # G: the next batch's ids, on the table's device
        out.pow(2).sum().backward()
        if rr is not None:
            rr.step(opt, HyperParams(lr=0.01))
            rr.wait()
        else:
            opt.step(HyperParams(lr=0.01))
        weights.append(emb.weight.detach().clone())
    _close(d, "relaxed_vs_sync", weights[1], weights[0], 1e-6)


def _scheduled(device: torch.device, cpu: bool, d: Dict[str, Any]) -> None:
    from embrace_fairseq.core import collectives
    from embrace_fairseq.schedule.executor import ScheduledAllReduce
    from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule
    from embrace_fairseq.core.trace import Tracer

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).to(device)
    params = list(model.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
    sched = build_schedule(specs, ScheduleOptions(piece_bytes=8192, bucket_bytes=65536, max_in_flight=2))
    tracer = Tracer()
    red = ScheduledAllReduce(params, sched, collectives.new_group(), tracer=tracer)
    assert red.single_thread == (not cpu), "NCCL issues from the autograd thread"
    model(torch.randn(16, 64, device=device)).sum().backward()
    grads = [p.grad.clone() for p in params]
    red.finish()
    for g, p in zip(grads, params):
        _close(d, "allreduce_world1", p.grad, g, 0.0)
    events = tracer.events("comm")
    assert events and all(e["dur"] >= 0 for e in events)
    d["pieces"], d["comm_us"] = len(events), sum(e["dur"] for e in events)


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _next_forward(device: torch.device, d: Dict[str, Any]) -> None:
    """Cross-iteration overlap on the group's backend: the deferred all-reduce waited for
    per layer in the next forward (on NCCL a stream wait), the same weights as the whole step."""
    from embrace_fairseq.core import collectives
    from embrace_fairseq.schedule.executor import ScheduledAllReduce
    from embrace_fairseq.schedule.next_forward import NextForwardUpdates
    from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

    ref, ours = _Layers().to(device), _Layers().to(device)
    params = list(ours.parameters())
    specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i) for i, p in enumerate(params)]
    sched = build_schedule(specs, ScheduleOptions(piece_bytes=8192, bucket_bytes=16640, max_in_flight=2))
    red = ScheduledAllReduce(params, sched, collectives.new_group())
    nf = NextForwardUpdates(ours, red)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def update(sub):
        keep = {id(p) for p in sub}
        saved = [(p, p.grad) for p in params if id(p) not in keep]
        for p, _ in saved:
            p.grad = None
        opt.step()
        for p, g in saved:
            p.grad = g

    in_forward = []
    for step in range(3):
        x = torch.randn(16, 64, device=device, generator=None)
        out_ref, out = ref(x), ours(x)
        in_forward.append(nf.updated_in_forward)  # the previous step's buckets, updated by this forward
        _close(d, f"next_forward_out{step}", out, out_ref, 1e-6)
        out_ref.sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        nf.flush()  # what the forward did not complete, before the backward (as the DeepSpeed hook does)
        out.sum().backward()
        nf.begin(update)
    nf.flush()
    for a, b in zip(ours.parameters(), ref.parameters()):
        _close(d, "next_forward_weights", a, b, 1e-6)
    d["next_forward_in_forward"] = in_forward
    if not all(k > 0 for k in in_forward[1:]):
        raise AssertionError(f"no bucket was updated inside the next forward: {in_forward}")


def _vp_reference(table: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor, eps: float):
    """Full-table fairseq-style loss in float64: loss, d hidden, d table."""
    from embrace_fairseq.core.vocab_parallel import label_smoothed_loss

    w = table.double().clone().requires_grad_()
    h = hidden.double().clone().requires_grad_()
    lp = F.log_softmax(h @ w.t(), dim=-1)
    loss = label_smoothed_loss(-lp.gather(1, target.unsqueeze(1)).sum(), -lp.sum(), eps, table.shape[0])
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _vocab_parallel_world_of_one(device: torch.device, cpu: bool, d: Dict[str, Any]) -> None:
    """The vocab-parallel loss on the device (no peer: the math, the one in-place buffer,
    logits under autocast and in half precision) against the float64 full-table loss."""
    from embrace_fairseq.core.vocab_parallel import VocabShardSpec, label_smoothed_loss, vocab_parallel_loss

    g = torch.Generator().manual_seed(3)
    V, D, T, eps = 3001, 64, 257, 0.1
    table, hidden = torch.randn(V, D, generator=g) * 0.3, torch.randn(T, D, generator=g)
    target = torch.randint(0, V, (T,), generator=g)
    ref_loss, ref_dh, ref_dw = _vp_reference(table, hidden, target, eps)
    modes = [("fp32", torch.float32, False)] + ([] if cpu else [("bf16_autocast", torch.float32, True),
                                                               ("bf16", torch.bfloat16, False)])
    for name, dtype, autocast in modes:
        w = table.to(device, dtype).requires_grad_()
        h = hidden.to(device, dtype).requires_grad_()
        spec = VocabShardSpec(rows=torch.arange(V, device=device), vocab_size=V, group=None)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            res = vocab_parallel_loss(h, w, target.to(device), spec, smoothing=True)
            loss = label_smoothed_loss(res.nll.sum(), res.smooth.sum(), eps, V)
        loss.backward()
        tol = 1e-4 if name == "fp32" else 3e-2
        scale = float(ref_loss.abs())
        _close(d, f"vp_loss_{name}", loss.detach().double().cpu() / scale, ref_loss / scale, tol)
        _close(d, f"vp_dhidden_{name}", h.grad.cpu(), ref_dh, tol * float(ref_dh.abs().max()))
        _close(d, f"vp_dtable_{name}", w.grad.cpu(), ref_dw, tol * float(ref_dw.abs().max()))


def vp_rank(rank: int, world: int, device_name: str) -> Dict[str, float]:
    """One rank of :func:`vocab_parallel`: its shard (strided) and its tokens (uneven, one
    rank without any in the second step) on ``device_name``, against the float64
    full-table loss of every rank's tokens."""
    from embrace_fairseq.core.vocab_parallel import VocabShardSpec, label_smoothed_loss, vocab_parallel_loss
    from embrace_fairseq.core.ledger import CommLedger
    from embrace_fairseq.core.trace import Tracer, TracingLedger

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out: Dict[str, float] = {}
    for step, counts in enumerate(([130, 71], [0, 96], [64, 64])):
        g = torch.Generator().manual_seed(10 + step)
        V, D, eps = 1001, 32, 0.1
        table = torch.randn(V, D, generator=g) * 0.3
        hidden = [torch.randn(n, D, generator=g) for n in counts]
        target = [torch.randint(0, V, (n,), generator=g) for n in counts]
        ref_loss, ref_dh, ref_dw = _vp_reference(table, torch.cat(hidden), torch.cat(target), eps)
        rows = torch.arange(rank, V, world)
        w = table[rows].to(device).requires_grad_()
        h = hidden[rank].to(device).requires_grad_()
        tracer = Tracer(rank)
        spec = VocabShardSpec(rows=rows.to(device), vocab_size=V, grad_scale=1.0, ledgers=(TracingLedger(tracer, CommLedger()),))
        res = vocab_parallel_loss(h, w, target[rank].to(device), spec, smoothing=True)
        loss = label_smoothed_loss(res.nll.sum(), res.smooth.sum(), eps, V)
        loss.backward()
        off = sum(counts[:rank])
        out[f"step{step}_loss"] = float(loss.detach().cpu())  # the ranks' losses sum to the reference
        if counts[rank]:
            out[f"step{step}_dhidden"] = float((h.grad.cpu().double() - ref_dh[off:off + counts[rank]]).abs().max())
        out[f"step{step}_dtable"] = float((w.grad.cpu().double() - ref_dw[rows]).abs().max())
        out[f"step{step}_ref_loss"] = float(ref_loss)
        out[f"step{step}_events"] = len(tracer.events("comm"))
    return out


def vocab_parallel(out: Path, cpu: bool) -> Dict[str, Any]:
    """The vocab-parallel loss on 2 gloo ranks whose tensors live on the device (both
    ranks on GPU 0: gloo takes CUDA tensors, NCCL would need two GPUs), so that its
    asynchronous gathers and reduce-scatter run with CUDA tensors and CUDA-event times;
    plus the world-of-one math on the device. Sums over the ranks' losses equal the
    float64 full-table loss; gradients within float32 rounding."""
    from embrace_fairseq.tools.local_ranks import run_ranks

    d: Dict[str, Any] = {}
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    _vocab_parallel_world_of_one(device, cpu, d)
    res = run_ranks(vp_rank, 2, str(device), timeout_s=120)
    for step in range(3):
        total = sum(r[f"step{step}_loss"] for r in res)
        ref = res[0][f"step{step}_ref_loss"]
        d[f"two_ranks_step{step}_loss_rel"] = abs(total - ref) / abs(ref)
        if not d[f"two_ranks_step{step}_loss_rel"] <= 1e-5:
            raise AssertionError(f"two ranks, step {step}: loss {total} vs {ref}")
        for r in res:
            for key in ("dhidden", "dtable"):
                err = r.get(f"step{step}_{key}", 0.0)
                if not err <= 1e-4:
                    raise AssertionError(f"two ranks, step {step}: {key} differs by {err}")
        if not all(r[f"step{step}_events"] > 0 for r in res):
            raise AssertionError("the traced ledger recorded no collective")
    d["two_ranks"] = res
    return {"status": "pass", "detail": d}


def exchange(out: Path, cpu: bool) -> Dict[str, Any]:
    import torch.distributed as dist

    device = init_world_of_one(cpu)
    d: Dict[str, Any] = {"backend": dist.get_backend(), "device": str(device)}
    try:
        dtypes = [torch.float32] if cpu else [torch.float32, torch.float16, torch.bfloat16]
        for dtype in dtypes:
            _lookup(dtype, device, d)
        _guards(device, d)
        _relaxed(device, d)
        _scheduled(device, cpu, d)
        _next_forward(device, d)
    finally:
        dist.destroy_process_group()
    return {"status": "pass", "detail": d}


def native(out: Path, cpu: bool) -> Dict[str, Any]:
    """Native kernels (CUDA on GPU, CPU with --cpu-smoke) bit-exact against the reference."""
    from embrace_fairseq.core import native_ops as N

    mod = N.native_module()
    if mod is None:
        return {"status": "skip", "detail": N.native_status()}
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if device.type == "cuda" and not mod.WITH_CUDA:
        return {"status": "skip", "detail": "the extension was built without CUDA kernels (gpu_check.sh builds them "
                                            "when nvcc is found)"}
    d: Dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (4096,), generator=g)
    ref = N.dedup_bucket_reference(ids, [0, 12_500, 25_000, 37_500, 50_000])
    got = N.dedup_bucket_native(ids.to(device), [0, 12_500, 25_000, 37_500, 50_000])
    assert torch.equal(got.unique_ids.cpu(), ref.unique_ids) and got.send_counts == ref.send_counts
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        table = torch.randn(3000, 64, generator=g).to(dtype)
        index = torch.randint(0, 3000, (5000,), generator=g)
        assert torch.equal(N.gather_rows_native(table.to(device), index.to(device)).cpu(),
                           N.gather_rows_reference(table, index))
        src = torch.randn(5000, 64, generator=g).to(dtype)
        want = N.scatter_add_rows_reference(src, index, 3000, 1.0 / 3, 7)
        have = N.scatter_add_rows_native(src.to(device), index.to(device), 3000, 1.0 / 3, 7).cpu()
        assert torch.equal(have, want), f"scatter_add_rows {dtype} differs from the CPU reference"
        d[f"bit_exact_{dtype}"] = True
    return {"status": "pass", "detail": d}
