"""Per-rank bodies of the fp16 headroom tests (spawned in real gloo ranks): gradient sums
over ranks whose total overflows half precision while the 1/N average DDP leaves does
not, through the node-aware exchange and the tied table's reduce-scatter."""
from __future__ import annotations

import torch

from embrace_fairseq import ShardedEmbedding

BIG = 40000.0  # fp16 max is 65504: two ranks' rows of BIG overflow when summed first
VOCAB, DIM = 11, 4  # divisible by neither 2, 3 nor 4


def random_grads(rank: int, shape) -> torch.Tensor:
    """Each rank's fp16 gradient: magnitudes 20000..60000, random signs (a sum over 2+
    ranks leaves the half range in many entries; an average never does)."""
    g = torch.Generator().manual_seed(1000 + rank)
    mag = 20000.0 + 40000.0 * torch.rand(shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (mag * sign).to(torch.float16)


def _shard_grad(emb: ShardedEmbedding) -> dict:
    return {"ids": emb.plan.vocab_ids(emb.rank).tolist(), "rows": emb.weight.grad.float().numpy().copy(),
            "dtype": str(emb.weight.grad.dtype)}


def node_exchange_rows(rank: int, world: int, ranks_per_node: int) -> dict:
    """The node-aware and the flat route: every rank sends a gradient row of BIG for id 3
    and of 1 for id 7 (``exact``), then random large rows for ids 0..9 (``random``), in
    an fp16 table; the owners' shard gradients. The per-node sum of id 3 is
    ``ranks_per_node * BIG``: above the half range."""
    out = {}
    for route in ("flat", "node"):
        per_case = {}
        for case in ("exact", "random"):
            torch.manual_seed(0)
            emb = ShardedEmbedding(VOCAB, DIM, dtype=torch.float16, exchange=route, ranks_per_node=ranks_per_node)
            assert emb.node_aware == (route == "node")
            if case == "exact":
                ids = torch.tensor([[3, 7]])
                grad = torch.stack([torch.full((DIM,), BIG), torch.ones(DIM)]).unsqueeze(0).to(torch.float16)
            else:
                ids = torch.arange(10).unsqueeze(0)
                grad = random_grads(rank, (1, 10, DIM))
            emb(ids).backward(grad)
            per_case[case] = _shard_grad(emb)
        out[route] = per_case
    return out


def table_grads(rank: int, world: int) -> dict:
    """The tied table's reduce-scatter on the whole world (synchronous and overlapped)
    and on the ranks {0, 1, 2} (synchronous): every rank's full-table gradient has BIG in
    row 3 and 1 in row 7 (``exact``), or random large values in every row (``random``)."""
    from embrace_fairseq.core import collectives

    trio = collectives.new_group([0, 1, 2])
    out = {}
    for members, group in ((world, None), (3, trio)):
        if rank >= members:
            continue
        for overlap in ((False, True) if group is None else (False,)):
            for case in ("exact", "random"):
                torch.manual_seed(0)
                emb = ShardedEmbedding(VOCAB, DIM, dtype=torch.float16, process_group=group)
                emb.set_table_overlap(overlap)
                assert emb.overlap_table == overlap
                if case == "exact":
                    g = torch.zeros(VOCAB, DIM)
                    g[3], g[7] = BIG, 1.0
                    g = g.to(torch.float16)
                else:
                    g = random_grads(rank, (VOCAB, DIM))
                full = emb.gathered_weight()
                assert full.dtype == torch.float16 and full.shape == (VOCAB, DIM)
                full.backward(g)
                emb.finish_pending()
                out[(members, overlap, case)] = _shard_grad(emb)
    return out


def fp16_headroom(rank: int, world: int, ranks_per_node: int) -> dict:
    """Both, in one spawn (rank start-up dominates)."""
    torch.set_num_threads(1)
    return {"node": node_exchange_rows(rank, world, ranks_per_node), "table": table_grads(rank, world)}
