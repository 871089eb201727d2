"""Overlapped full-table exchange of a tied output projection, in real gloo ranks:
the same training as the synchronous exchange and as a replicated table."""
import pytest
import torch

import rank_fns_table_overlap as R
from embrace_fairseq.tools.local_ranks import run_ranks

RTOL = 1e-5


def _rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check(results, accum):
    for res in results:
        ref = res["replicated"]
        for mode in ("sync", "overlap"):
            got = res[mode]
            assert _rel(got["losses"], ref["losses"]) < RTOL, (mode, got["losses"], ref["losses"])
            for name in ref["state"]:
                assert _rel(got["state"][name], ref["state"][name]) < RTOL, (mode, name)
        ovl, sync = res["overlap"], res["sync"]
        # the reduce-scatters were still in flight when backward returned (one per micro-batch)
        assert ovl["pending"][-accum:] == list(range(1, accum + 1))
        assert ovl["grad_gap"] > 0
        # same bytes as the synchronous exchange, on their own groups
        assert ovl["bytes"] == sync["bytes"] and sync["bytes"]["table_gather"] > 0


def test_overlap_matches_sync_and_replicated_and_is_never_stale():
    """2 ranks, uneven vocab, two backwards per step, clipping; then a prefetched
    table is dropped when the weights change (one spawn: rank start-up dominates)."""
    results = run_ranks(R.quick_suite, 2, 37, timeout_s=120)
    _check([r["training"] for r in results], 2)
    for r in results:
        out = r["fresh"]
        assert out["after_load"] == 0.0
        assert out["after_inplace"] == 0.0
        assert out["dropped_by_finish"]
        assert out["after_finish"] == 0.0


@pytest.mark.parametrize("world,vocab,accum,clip", [(3, 37, 1, 0.0), (3, 37, 2, 0.05), (2, 36, 1, 0.0), (3, 8, 2, 0.0)])
def test_overlap_matches_more_worlds(world, vocab, accum, clip):
    _check(run_ranks(R.tied_training, world, vocab, 4, accum, clip, timeout_s=180), accum)

