import time

import pytest
import torch

from embrace_fairseq import InvalidIdError, ShardedEmbedding, ShardPlan, fairseq_initial_table
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_embedding as fns

CASES = ["random", "padding", "repeats", "one_shard", "empty_rank"]
TOL = 1e-6


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_replicated_embedding(world):
    vocab, dim = 11, 4  # 11 rows: not divisible by 2, 3 or 4
    results = run_ranks(fns.compare_with_replicated, world, vocab, dim, CASES)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            where = f"world={world} rank={rank} case={case}"
            assert r["shape_ok"], where
            assert r["init_diff"] == 0.0, where
            assert r["fwd_diff"] == 0.0, where
            assert r["grad_diff"] < TOL, (where, r)
            assert r["pad_grad"] == 0.0, where
            assert r["full_diff"] == 0.0, where


@pytest.mark.parametrize("world,opt", [(2, "sgd"), (3, "adam"), (3, "sgd"), (2, "adam")])
def test_optimizer_step_matches_replicated(world, opt):
    diffs = run_ranks(fns.optimizer_step, world, 10, 3, opt)
    assert max(diffs) < 1e-6, diffs


def test_bytes_match_hand_count():
    snaps = run_ranks(fns.fixed_batch_bytes, 2)
    # V=10 over 2 ranks: rank 0 owns 0..4, rank 1 owns 5..9; D=4 fp32 rows of 16 bytes.
    # rank 0 unique ids {0,1,2,7}: 3 stay, 1 goes to rank 1. rank 1 unique {3,5,6}: 1 goes to rank 0.
    header = 1 * 3 * 8  # one peer, 3 int64 fields
    for rank in (0, 1):
        s = snaps[rank]
        assert s["sent"]["counts"] == header and s["received"]["counts"] == header
        assert s["sent"]["ids"] == 4 and s["received"]["ids"] == 4  # one int32 id each way
        assert s["sent"]["rows"] == 16 and s["received"]["rows"] == 16
        assert s["sent"]["grad_rows"] == 16 and s["received"]["grad_rows"] == 16


def test_shared_exchange_for_several_lookups():
    for r in run_ranks(fns.shared_exchange, 3):
        assert r["joint_calls"] == 1 and r["separate_calls"] == 2
        assert r["fwd"] == 0.0 and r["grad"] < TOL


@pytest.mark.parametrize("bad_value", [11, -1])
def test_bad_id_raises_on_every_rank_quickly(bad_value):
    t0 = time.monotonic()
    results = run_ranks(fns.bad_id, 3, 1, bad_value, timeout_s=60)
    assert time.monotonic() - t0 < 60
    for status, msg in results:
        assert status == "raised"
        assert str(bad_value) in msg and "11 rows" in msg and "rank 1" in msg


def test_state_dict_holds_full_table_and_reshards():
    for r in run_ranks(fns.checkpoint_roundtrip, 2):
        assert r["refused_unconsolidated"] and r["full_rows"] == 9 and r["same"]


def test_world_of_one_without_process_group():
    torch.manual_seed(0)
    emb = ShardedEmbedding(5, 3, padding_idx=2)
    torch.manual_seed(0)
    assert torch.equal(emb.weight.detach(), fairseq_initial_table(5, 3, 2))
    assert emb.shard_range == (0, 5) and not emb.is_sharded
    ids = torch.tensor([[0, 2, 4]])
    assert torch.equal(emb(ids), emb.weight[ids])
    with pytest.raises(InvalidIdError, match="id 5 .* 5 rows"):
        emb(torch.tensor([5]))


@pytest.mark.parametrize("vocab", [0, 1, 2, 3, 7, 10, 11, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_plan(vocab, world):
    plan = ShardPlan(vocab, world, layout="contiguous")  # shard_range as vocabulary ranges
    sizes = plan.sizes
    assert sum(sizes) == vocab and max(sizes) - min(sizes) <= 1
    ids = torch.arange(vocab)
    owners = plan.owner(ids)
    local = plan.local_index(ids)
    for i in range(vocab):
        start, end = plan.shard_range(int(owners[i]))
        assert start <= i < end and int(local[i]) == i - start
