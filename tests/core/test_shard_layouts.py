"""Shard layouts: the plan's maps, and a sharded table under each layout against the
replicated reference (forward rows, gradients, Adam, full tables, bad ids, agreement,
checkpoints across layouts and world sizes)."""
import numpy as np
import pytest
import torch

from embrace_fairseq import ShardedEmbedding, ShardPlan
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, LAYOUTS
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_layouts as fns

TOL = 1e-6
CASES = ["random", "padding", "repeats", "one_shard", "empty_rank"]


# ---------------------------------------------------------------------- the plan


def test_default_layout_is_strided():
    assert DEFAULT_LAYOUT == "strided" and ShardPlan(10, 2).layout == "strided"
    assert ShardedEmbedding(10, 2).layout == "strided"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("vocab", [0, 1, 2, 3, 7, 10, 11, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_plan_maps(vocab, world, layout):
    plan = ShardPlan(vocab, world, layout)
    assert plan.sizes == ShardPlan(vocab, world, "contiguous").sizes  # same sizes in every layout
    ids = torch.arange(vocab)
    owner, local, pid = plan.owner(ids), plan.local_index(ids), plan.to_plan(ids)
    assert sorted(pid.tolist()) == list(range(vocab))  # a permutation
    assert torch.equal(plan.to_vocab(pid), ids)
    for r in range(world):
        start, end = plan.shard_range(r)
        mine = owner == r
        assert int(mine.sum()) == end - start
        assert sorted(local[mine].tolist()) == list(range(end - start))
        assert torch.equal(pid[mine], start + local[mine])  # plan order: one block per owner
        assert torch.equal(plan.vocab_ids(r)[local[mine]], ids[mine])
    if vocab:
        assert plan.owner_of(vocab - 1) == int(owner[-1]) and plan.local_index_of(vocab - 1) == int(local[-1])
    full = torch.randn(vocab, 3)
    parts = [plan.shard_rows(full, r) for r in range(world)]
    padded = [torch.cat([p, torch.full((plan.max_shard_size - p.shape[0], 3), 7.0)]) for p in parts]
    assert torch.equal(plan.assemble(padded), full)
    assert torch.equal(plan.to_plan_order(full), torch.cat(parts))
    assert torch.equal(plan.to_vocab_order(plan.to_plan_order(full)), full)
    assert torch.equal(plan.to_plan_order(full), full[plan.to_vocab(torch.arange(vocab))])  # row p = vocab id of p
    vec = torch.randn(vocab)  # 1-D tensors (a bias, a row count) permute too
    assert torch.equal(plan.to_vocab_order(plan.to_plan_order(vec)), vec)


@pytest.mark.parametrize("vocab,world", [(7, 2), (11, 3), (1001, 8), (64, 4)])
def test_permutation_gradients_are_the_inverse_permutation(vocab, world):
    """The table's gradient goes back through the permutations as the inverse one, so a
    tied projection's reduce-scatter sees it in plan order."""
    plan = ShardPlan(vocab, world, "strided")
    plan_full = torch.randn(vocab, 3, requires_grad=True)
    g = torch.randn(vocab, 3)
    (plan.to_vocab_order(plan_full) * g).sum().backward()
    assert torch.equal(plan_full.grad, plan.to_plan_order(g))
    full = torch.randn(vocab, 3, requires_grad=True)
    (plan.to_plan_order(full) * g).sum().backward()
    assert torch.equal(full.grad, plan.to_vocab_order(g))


def test_strided_owner_and_identity():
    plan = ShardPlan(10, 3, "strided")
    assert plan.owner(torch.arange(10)).tolist() == [0, 1, 2] * 3 + [0]
    assert plan.local_index(torch.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert plan.vocab_ids(1).tolist() == [1, 4, 7]
    assert not plan.is_identity
    assert ShardPlan(10, 3, "contiguous").is_identity and ShardPlan(10, 1).is_identity
    ids = torch.tensor([4, 5])
    assert ShardPlan(10, 3, "contiguous").to_plan(ids) is ids  # nothing to do: no copy


def test_invalid_ids_keep_their_value_in_plan_order():
    plan = ShardPlan(11, 3)
    assert plan.to_plan(torch.tensor([-1, 11, 100, 5])).tolist()[:3] == [-1, 11, 100]


def test_fingerprint_covers_layout_and_unknown_layout_is_refused():
    assert ShardPlan(11, 3, "strided").fingerprint() != ShardPlan(11, 3, "contiguous").fingerprint()
    with pytest.raises(ValueError, match="unknown shard layout 'rows'.*strided, contiguous"):
        ShardPlan(11, 3, "rows")
    with pytest.raises(ValueError, match="unknown shard layout"):
        ShardedEmbedding(11, 3, layout="mod")


def test_world_of_one_any_layout():
    for layout in LAYOUTS:
        torch.manual_seed(0)
        emb = ShardedEmbedding(5, 3, padding_idx=2, layout=layout)
        assert emb.vocab_ids().tolist() == [0, 1, 2, 3, 4]
        ids = torch.tensor([[0, 2, 4]])
        assert torch.equal(emb(ids), emb.weight[ids])


# ---------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_replicated_embedding(world, layout):
    vocab, dim = 11, 4  # 11 rows: not divisible by 2, 3 or 4
    results = run_ranks(fns.compare_layout, world, vocab, dim, CASES, layout)
    owned = sorted(i for per_case in results for i in per_case["random"]["owned"])
    assert owned == list(range(vocab))  # every row owned once
    for rank, per_case in enumerate(results):
        if layout == "strided":
            assert per_case["random"]["owned"] == list(range(rank, vocab, world))
        for case, r in per_case.items():
            where = f"layout={layout} world={world} rank={rank} case={case}"
            assert r["shape_ok"], where
            assert r["init_diff"] == 0.0, where
            assert r["fwd_diff"] == 0.0, where
            assert r["grad_diff"] < TOL, (where, r)
            assert r["pad_grad"] == 0.0, where
            assert r["full_diff"] == 0.0, where


@pytest.mark.parametrize("world", [2, 3])
def test_tied_projection_strided(world):
    """A tied output projection reads the full table in vocabulary order (columns of
    the logits are vocabulary ids) and its gradient reaches the right owners."""
    results = run_ranks(fns.compare_layout, world, 13, 4, ["random", "padding", "empty_rank"], "strided", True)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            assert r["fwd_diff"] == 0.0 and r["full_diff"] == 0.0, (rank, case)
            assert r["grad_diff"] < 1e-5, (rank, case, r)


@pytest.mark.parametrize("world,layout", [(2, "strided"), (3, "strided"), (3, "contiguous"), (4, "strided")])
def test_adam_matches_replicated(world, layout):
    for r in run_ranks(fns.adam_steps, world, 10, 3, layout):
        assert r["table"] < 1e-6 and r["exp_avg"] < 1e-6 and r["exp_avg_sq"] < 1e-6, r


def test_bytes_follow_the_layout():
    """V=10 over 2 ranks; rank 0 asks {0,1,2,7}, rank 1 asks {3,5,6}. Contiguous (0..4 | 5..9):
    one row each way. Strided (even | odd): rank 0 asks 1 and 7 of rank 1, rank 1 asks 6 of rank 0."""
    ids = [torch.tensor([[1, 2, 2], [7, 0, 0]]), torch.tensor([5, 6, 3])]
    row = 4 * 4
    cont = run_ranks(fns.bytes_of_one_step, 2, 10, 4, "contiguous", ids)
    assert cont[0] == cont[1] == {"rows": (row, row), "grad_rows": (row, row)}
    strided = run_ranks(fns.bytes_of_one_step, 2, 10, 4, "strided", ids)
    assert strided[0] == {"rows": (row, 2 * row), "grad_rows": (2 * row, row)}
    assert strided[1] == {"rows": (2 * row, row), "grad_rows": (row, 2 * row)}


@pytest.mark.parametrize("bad_value", [11, -1, -3])
def test_bad_id_raises_on_every_rank_strided(bad_value):
    # -1 and -3 would map to valid plan ids if they were mapped before validation
    for status, msg in run_ranks(fns.bad_id, 3, "strided", 1, bad_value, timeout_s=60):
        assert status == "raised" and str(bad_value) in msg and "11 rows" in msg and "rank 1" in msg, msg


def test_ranks_with_other_layouts_stop_at_start_up():
    for status, msg in run_ranks(fns.mismatched_layouts, 2, timeout_s=60):
        assert status == "raised", msg
        assert "layout differs" in msg and "strided" in msg and "contiguous" in msg, msg


def test_set_layout_reshards_in_place():
    res = run_ranks(fns.relayout, 3, 11, 3)
    for rank, r in enumerate(res):
        assert r["same_param"] and r["full"] == 0.0 and r["lookup"] == 0.0 and r["layout"] == "strided"
        assert r["owned"] == list(range(rank, 11, 3))


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("save_world,save_layout,loads", [
    # four launches (~35 s): in the slow set; the default run keeps the case below
    pytest.param(2, "strided", [(3, "contiguous"), (1, "strided"), (4, "strided")], marks=pytest.mark.slow),
    (3, "contiguous", [(2, "strided")]),
])
def test_checkpoint_round_trip_between_layouts_and_world_sizes(tmp_path, save_world, save_layout, loads):
    vocab, dim = 13, 3
    path = str(tmp_path / "ckpt.pt")
    saved = run_ranks(fns.save_sharded, save_world, vocab, dim, save_layout, path)[0]
    for world, layout in loads:
        for rank, r in enumerate(run_ranks(fns.load_sharded, world, vocab, dim, layout, path)):
            where = (world, layout, rank)
            assert r["local_ok"], where
            for key in ("table", "exp_avg", "exp_avg_sq"):
                assert np.array_equal(r[key], saved[key]), (where, key)
