"""CPU-checkable parts of the GPU-path fixes: fp16 gradient rows scaled before their
rounding on real gloo ranks, the relaxed rows' split sizes from one host sync (equal to
synchronous training on 2 and 3 ranks), and the host integers staged without a sync."""
import numpy as np
import torch

import rank_fns_gpu_paths as R
from embrace_fairseq.core.relaxed_rows import _segment_counts, _where
from embrace_fairseq.tools.local_ranks import run_ranks


def test_segment_counts_exact():
    m1 = torch.tensor([True, False, True, True, False, True])
    m2 = torch.tensor([False, True, True])
    assert _segment_counts([(m1, [2, 0, 3, 1]), (m2, [1, 2])]) == [[1, 0, 2, 1], [0, 2]]
    assert _segment_counts([(torch.zeros(0, dtype=torch.bool), [0, 0])]) == [[0, 0]]
    assert _where(m1, 4).tolist() == [0, 2, 3, 5]


def test_fp16_rows_and_relaxed_rows_on_2_and_3_ranks():
    """One spawn of 3 ranks, the tables over all 3 and over the pair {0, 1}:

    * fp16: every rank sends a gradient row of 40000 for id 3 (fp16 max 65504); its owner
      sums them: the sum overflows fp16, the 1/world average DDP leaves does not. Exact.
    * relaxed rows (23 rows, uneven), three Adam steps: the shards equal the synchronous
      ones (up to fp32 rounding of where the 1/world scale is applied)."""
    per_rank = run_ranks(R.gpu_paths, 3, timeout_s=150)
    for members in (3, 2):
        rows = {}
        for rank in range(members):
            r = per_rank[rank][members]["fp16"]
            assert r["dtype"] == "torch.float16"
            rows.update(zip(r["ids"], r["rows"]))
        assert sorted(rows) == list(range(11)), members
        assert (rows[3] == R.BIG).all(), (members, rows[3])
        assert (rows[7] == 1.0).all(), (members, rows[7])
        assert all((rows[i] == 0).all() for i in rows if i not in (3, 7)), members
        for rank in range(members):
            sync, relaxed = per_rank[rank][members]["relaxed"][False], per_rank[rank][members]["relaxed"][True]
            assert np.abs(sync).max() > 0
            assert np.abs(relaxed - sync).max() <= 1e-6 * max(1.0, np.abs(sync).max()), (members, rank)
    assert 2 not in per_rank[2]
