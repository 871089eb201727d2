"""Per-rank bodies of the CPU tests of the GPU-path fixes (fp16 row scaling, relaxed rows'
split sizes, ZeRO-1's overflow decision over the shards), spawned in real gloo ranks."""
from __future__ import annotations

import os

import torch

from embrace_fairseq import ShardedEmbedding

BIG = 40000.0  # fp16 max is 65504: two ranks' rows of BIG overflow when summed first


def gpu_paths(rank: int, world: int):
    """:func:`fp16_rows` and :func:`relaxed_vs_sync` over all ranks and over the pair
    {0, 1} (one spawn, two world sizes)."""
    from embrace_fairseq.core import collectives

    pair, relaxed_pair, relaxed_all = (collectives.new_group([0, 1]), collectives.new_group([0, 1]),
                                       collectives.new_group())
    out = {}
    for members, group, relaxed_group in ((world, None, relaxed_all), (2, pair, relaxed_pair)):
        if rank < members:
            out[members] = {"fp16": fp16_rows(rank, group), "relaxed": relaxed_vs_sync(rank, group, relaxed_group)}
    return out


def fp16_rows(rank: int, group=None):
    """Every rank looks up id 3 (gradient BIG) and id 7 (gradient 1) once in an fp16 table:
    the owners' shard gradients, in full-table order (float32 numpy)."""
    torch.manual_seed(0)
    emb = ShardedEmbedding(11, 4, dtype=torch.float16, process_group=group)
    ids = torch.tensor([[3, 7]])
    out = emb(ids)
    grad = torch.stack([torch.full((4,), BIG), torch.ones(4)]).unsqueeze(0).to(torch.float16)
    out.backward(grad)
    return {"ids": emb.plan.vocab_ids(emb.rank).tolist(), "rows": emb.weight.grad.float().numpy().copy(),
            "dtype": str(emb.weight.grad.dtype)}


def relaxed_vs_sync(rank: int, group=None, relaxed_group=None, steps: int = 3):
    """Three Adam steps of a sharded table: synchronous, then relaxed (the rows the next
    batch reads now, the others on the background thread), the same batches: the shards."""
    from embrace_fairseq.core.relaxed_rows import RelaxedRows
    from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer

    torch.set_num_threads(1)
    batches = [torch.randint(0, 23, (3, 5), generator=torch.Generator().manual_seed(10 * s + rank))
               for s in range(steps + 1)]
    shards = {}
    for relaxed in (False, True):
        torch.manual_seed(4)
        emb = ShardedEmbedding(23, 6, padding_idx=1, process_group=group)
        opt = ShardOptimizer([emb.weight], "adam")
        rr = RelaxedRows([emb], relaxed_group) if relaxed else None
        for s in range(steps):
            out = emb(batches[s])
            if rr is not None:
                rr.next_batch([[batches[s + 1]]])
            (out.float() * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
            if rr is not None:
                rr.step(opt, HyperParams(lr=0.05))
            else:
                opt.step(HyperParams(lr=0.05))
            opt.zero_grad()
        if rr is not None:
            rr.wait()
        shards[relaxed] = emb.weight.detach().numpy().copy()
    return shards


def zero1_overflow_decision(rank: int, world: int):
    """ZeRO-1 with ``compute_grad_norm: false`` (its overflow check is the only decision):
    after a backward, DeepSpeed's ``has_overflow`` on every rank, with finite gradients
    and with a NaN planted in the last rank's shard gradient alone."""
    import rank_fns_deepspeed as R

    R._ds_env(rank, world)
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT", "29511")
    torch.set_num_threads(1)
    from embrace_fairseq.deepspeed_adapter import initialize

    model = R.TinyLM(True, True)
    cfg = R._ds_config(stage=1, clip=0.0)
    cfg["zero_optimization"] = {"stage": 1, "compute_grad_norm": False}
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)
    out = {}
    for step, poison in ((0, False), (1, True)):
        ids, tgt = R._batch(step, rank)
        engine.backward(engine(ids, tgt))
        if poison and rank == world - 1:
            model.emb.weight.grad[0, 0] = float("nan")
        out[poison] = bool(engine.optimizer.has_overflow(partition_gradients=engine.optimizer.partition_gradients))
        engine.optimizer.zero_grad(set_to_none=True)
        model.emb.weight.grad = None
    return out
