"""table_dist in real gloo ranks, uneven shards (and an empty one): gather_full,
reduce_scatter_rows, gather_table, PendingGather and PendingTableGrads against the
full-table reference computed from all ranks' inputs in this process."""
import numpy as np
import pytest
import torch

import rank_fns_core as C

S = C.TABLE_SCALE


def _results():
    return C.core_results("table_dist")  # one spawn of 3 ranks per session, shared by tests/core


def summed(vocab, members, which):
    """sum over ranks of each rank's full-table gradient ``which``, times the scale."""
    return S * sum(C.table_grad_for(q, vocab, which).double() for q in range(members)).numpy()


@pytest.mark.parametrize("vocab,members", C.CONFIGS)
def test_full_table_on_every_rank(vocab, members):
    table = C.full_table(vocab).numpy()
    for rank in range(members):
        r = _results()[rank][(vocab, members)]
        for key in ("gather_full", "gather_table", "pending_gather"):
            assert r[key].shape == table.shape and np.array_equal(r[key], table), (rank, key)
        assert r["pending_same_object"]


@pytest.mark.parametrize("vocab,members", C.CONFIGS)
def test_gradients_reduce_scattered_to_the_owners(vocab, members):
    bounds = C.hand_bounds(vocab, members)
    for rank in range(members):
        r = _results()[rank][(vocab, members)]
        lo, hi = bounds[rank], bounds[rank + 1]
        assert tuple(r["range"]) == (lo, hi)
        checks = {
            "reduce_scatter": summed(vocab, members, 0)[lo:hi],
            "gather_table_grad": summed(vocab, members, 1)[lo:hi],
            # two reduce-scatters in flight, added to the 0.5 already in .grad
            "pending_grads": 0.5 + summed(vocab, members, 2)[lo:hi] + summed(vocab, members, 3)[lo:hi],
        }
        for key, want in checks.items():
            assert r[key].shape == want.shape, (rank, key)
            assert np.allclose(r[key], want, rtol=0, atol=1e-5), (rank, key, r[key], want)
        assert r["in_flight"] == 2 and r["in_flight_after"] == 0


def test_a_rank_without_rows_takes_part():
    """Vocabulary 2 over 3 ranks: rank 2 holds no row and still gathers the whole table."""
    r = _results()[2][(2, 3)]
    assert tuple(r["range"]) == (2, 2) and r["reduce_scatter"].shape == (0, C.DIM)
    assert np.array_equal(r["gather_full"], C.full_table(2).numpy())
