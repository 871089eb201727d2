"""fp16 headroom of the gradient sums over ranks (real gloo ranks): the node-aware
exchange's per-node sums and the tied table's reduce-scatter scale by 1/N before their
one rounding to half, so a sum over ranks that overflows fp16 leaves the finite average
DDP leaves (it divides before it sums). fp32 results are covered by the routes' own
tests (test_node_exchange.py, test_table_dist.py, test_table_overlap.py)."""
import numpy as np
import torch

import rank_fns_fp16_headroom as R
from embrace_fairseq.core.collectives import sum_row_blocks
from embrace_fairseq.tools.local_ranks import run_ranks

WORLD, RANKS_PER_NODE = 4, 2  # two emulated nodes of two ranks


def _full(shards):
    """The owners' shard gradients assembled in vocabulary order (float64)."""
    rows = {}
    for g in shards:
        assert g["dtype"] == "torch.float16"
        rows.update(zip(g["ids"], g["rows"]))
    assert sorted(rows) == list(range(R.VOCAB)), sorted(rows)
    return np.stack([rows[i] for i in range(R.VOCAB)]).astype(np.float64)


def _mean_of(members, make):
    """The reference: the ranks' fp16 gradients averaged in float64."""
    return np.mean([make(rank).double().numpy() for rank in range(members)], axis=0)


def _check(got, want, where):
    assert np.isfinite(got).all(), (where, got)
    # one rounding to fp16 of the fp32 average: within half an fp16 ulp (2^-11 relative)
    assert np.abs(got - want).max() <= 2.0 ** -10 * np.abs(want).max(), (where, np.abs(got - want).max())


def test_sum_row_blocks_scales_half_before_its_rounding():
    blocks = torch.full((3, 2, 4), R.BIG).to(torch.float16)
    assert torch.equal(sum_row_blocks(blocks, 1.0 / 3), torch.full((2, 4), R.BIG).to(torch.float16))
    assert torch.isinf(sum_row_blocks(blocks)).all()  # no scale: the sum itself, which overflows
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sum_row_blocks(x, 0.25), x.sum(0).mul_(0.25))  # fp32: the same ops as before


def test_fp16_sums_over_ranks_keep_the_average():
    """One spawn of 4 ranks:

    * node-aware exchange, 2 nodes x 2 ranks: id 3's per-node sum is 2 x 40000 (above
      fp16's 65504), its average 40000: exact, and equal to the flat route; random rows
      of magnitude 20000..60000 equal the float64 average within fp16 rounding;
    * tied table's reduce-scatter over 4 ranks (synchronous and overlapped) and over 3
      ranks (vocabulary 11: uneven shards): the same."""
    per_rank = run_ranks(R.fp16_headroom, WORLD, RANKS_PER_NODE, timeout_s=150)
    exact = np.zeros((R.VOCAB, R.DIM))
    exact[3], exact[7] = R.BIG, 1.0

    node = [r["node"] for r in per_rank]
    for route in ("flat", "node"):
        got = _full([n[route]["exact"] for n in node])
        assert np.array_equal(got, exact), (route, got[3], got[7])
        want = np.zeros((R.VOCAB, R.DIM))
        want[:10] = _mean_of(WORLD, lambda k: R.random_grads(k, (1, 10, R.DIM))[0])
        _check(_full([n[route]["random"] for n in node]), want, route)

    for members, overlap in ((WORLD, False), (WORLD, True), (3, False)):
        tables = [r["table"] for r in per_rank[:members]]
        assert all((members, overlap, "exact") not in r["table"] for r in per_rank[members:])
        got = _full([t[(members, overlap, "exact")] for t in tables])
        assert np.array_equal(got, exact), (members, overlap, got[3], got[7])
        want = _mean_of(members, lambda k: R.random_grads(k, (R.VOCAB, R.DIM)))
        _check(_full([t[(members, overlap, "random")] for t in tables]), want, (members, overlap))
