"""grad_norm: the global norm from a replicated part and sharded parts, and the
non-finite report, apart and in one pass (one process, and three real ranks for the
combined one)."""
import math

import pytest
import torch

from embrace_fairseq.optim.grad_norm import (
    NonFiniteGradientError,
    combine_norms,
    nonfinite_and_norm,
    nonfinite_gradients,
    raise_if_nonfinite,
    sharded_sq_norm,
)


def test_combined_norm_equals_the_norm_of_everything():
    torch.manual_seed(0)
    dense = [torch.randn(4, 3), torch.randn(7)]
    table = torch.randn(10, 3)
    shards = [table[:4], table[4:7], table[7:]]  # three ranks' shards, summed as the all-reduce would
    sq = sum(sharded_sq_norm([s]) for s in shards)
    dense_norm = torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in dense]))
    total = combine_norms(dense_norm, sq)
    want = torch.linalg.vector_norm(torch.cat([d.reshape(-1) for d in dense] + [table.reshape(-1)]))
    assert total.dtype == torch.float32 and torch.allclose(total, want, rtol=1e-6)


def test_empty_shard_list_and_dtypes():
    assert float(sharded_sq_norm([])) == 0.0
    g = torch.tensor([3.0, 4.0], dtype=torch.float16)
    assert float(sharded_sq_norm([g])) == 25.0 and sharded_sq_norm([g]).dtype == torch.float32
    assert float(combine_norms(torch.tensor(0.0, dtype=torch.float64), torch.tensor(25.0))) == 5.0


def test_non_finite_propagates():
    assert math.isinf(float(combine_norms(torch.tensor(1.0), sharded_sq_norm([torch.tensor([float("inf")])]))))
    assert math.isnan(float(combine_norms(torch.tensor(float("nan")), torch.tensor(1.0))))


def test_nonfinite_report_names_parameters():
    named = [("fc.weight", torch.ones(2)), ("emb.weight", torch.tensor([1.0, float("nan")])), ("b", None)]
    bad = nonfinite_gradients(named)
    assert bad == [("emb.weight", 0)]
    with pytest.raises(NonFiniteGradientError, match=r"non-finite \(inf/NaN\) gradient: emb.weight on rank 0"):
        raise_if_nonfinite(bad)
    raise_if_nonfinite([])
    assert nonfinite_gradients([]) == []


def test_nonfinite_report_is_exact_where_a_norm_overflows():
    # every element finite, but the float32 norm overflows: the exact round clears it
    huge = torch.full((4,), 3e38)
    assert not math.isfinite(float(torch.linalg.vector_norm(huge)))
    assert nonfinite_gradients([("big", huge), ("ok", torch.ones(3))]) == []
    assert nonfinite_gradients([("big", huge), ("inf", torch.tensor([1.0, float("-inf")]))]) == [("inf", 0)]
    half = torch.tensor([1.0, float("nan")], dtype=torch.float16)
    assert nonfinite_gradients([("h", half)]) == [("h", 0)]


def test_check_and_norm_in_one_pass_single_process():
    named = [("w", torch.tensor([3.0])), ("rows", torch.tensor([4.0])), ("none", None)]
    bad, norm = nonfinite_and_norm(named, [False, True, False])
    assert bad == [] and float(norm) == 5.0 and norm.dtype == torch.float32
    bad, norm = nonfinite_and_norm([("w", torch.tensor([1.0, float("inf")]))], [False])
    assert bad == [("w", 0)] and math.isinf(float(norm))
    huge = torch.full((4,), 3e38)  # every element finite, the norm overflows: not reported, norm inf
    bad, norm = nonfinite_and_norm([("big", huge)], [True])
    assert bad == [] and math.isinf(float(norm))
    assert nonfinite_and_norm([], []) == ([], torch.tensor(0.0))


def test_check_and_norm_over_three_ranks():
    """One all-reduce for both: the same report as nonfinite_gradients and the same norm
    as combine_norms of sharded_sq_norm on every rank; the norm is that of every rank's
    shards with one copy of the replicated gradients."""
    import rank_fns_grad_norm as fns
    from embrace_fairseq.tools.local_ranks import run_ranks

    results = run_ranks(fns.check_and_norm, 3, timeout_s=120, pg_timeout_s=60)
    shards = [fns.grads(r, "finite")[0][2][1] for r in range(3)]
    dense = [g for _, g in fns.grads(0, "finite")[0][:2]]
    want = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in dense + shards])))
    for rank, res in enumerate(results):
        assert res["finite"]["found"] == [] and res["finite"]["norm"] == pytest.approx(want, rel=1e-6)
        assert res["finite"]["norm"] == pytest.approx(res["finite"]["old_norm"], rel=1e-6)
        assert res["nan"]["found"] == res["nan"]["old_found"] == [("emb.weight", 2)], (rank, res["nan"])
        assert math.isnan(res["nan"]["norm"])
        assert res["overflow"]["found"] == res["overflow"]["old_found"] == [], (rank, res["overflow"])
        assert math.isinf(res["overflow"]["norm"])


def test_local_nonfinite_flag_stays_on_the_device_and_sees_every_gradient():
    from embrace_fairseq.optim.grad_norm import local_nonfinite

    finite = [torch.ones(3), None, torch.zeros(2, 2)]
    assert local_nonfinite(finite).tolist() == [False]
    assert local_nonfinite([]).tolist() == [False]
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = torch.zeros(2, 2)
        g[1, 0] = bad
        flag = local_nonfinite(finite + [g])
        assert flag.dtype == torch.bool and flag.shape == (1,) and flag.tolist() == [True]
