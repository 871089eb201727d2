"""No deadlock at a fence of the single-thread issue mode, on real gloo ranks.

Rank 0 issues from its gradient hooks a piece that rank 1 has no gradient for before the
fence (its graph lacks that layer), then blocks on every collective it issued before it
reaches the fence -- what a device-wide synchronisation (an out-of-memory retry of the
CUDA caching allocator, ``empty_cache``) does to a GPU rank whose device waits in that
piece for its peers. Rank 1 waits at the fence meanwhile. With a plain host vote at the
fence, rank 1 would issue the piece only after the vote, which rank 0 never joins: both
ranks hang until the process group's timeout. Rank 1 reads rank 0's post on the issue
board while its vote is in flight and issues the piece (zeros for the missing layer), so
both go on, and the gradients are the plain average of every rank's."""
import torch

import rank_fns_issue_stall as R
from embrace_fairseq.tools.local_ranks import run_ranks


def test_a_rank_blocked_between_issue_and_fence_does_not_deadlock():
    # a deadlock: the group's timeout (10 s) on rank 1, rank 0 hung until the 60 s limit
    res = run_ranks(R.stall_before_fence, 2, timeout_s=60, pg_timeout_s=10)
    # the case happened: rank 0 had issued more than rank 1 when each came to the fence
    for step in range(R.STEPS):
        assert res[0]["issued_before_fence"][step] > res[1]["issued_before_fence"][step], res
    assert res[0]["fence_rounds"] == res[1]["fence_rounds"] == R.STEPS
    assert res[0]["no_grad_last_step"] == [] and res[1]["no_grad_last_step"] == [2, 3]  # the tail
    for step in range(R.STEPS):
        expected = [sum(torch.tensor(r["local"][step][i]) for r in res) / len(res) for i in range(6)]
        for r in res:
            for got, want in zip(r["reduced"][step], expected):
                torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-7)
