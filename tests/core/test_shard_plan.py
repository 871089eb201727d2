"""shard_plan (contiguous layout; the strided one: tests/core/test_shard_layouts.py): vocab ranges, sizes within one row, owner/local_index round trip,
for any vocabulary and world size (a vocabulary smaller than the world included)."""
import pytest
import torch

from embrace_fairseq.core.shard_plan import ShardPlan


@pytest.mark.parametrize("vocab", [0, 1, 2, 3, 7, 10, 11, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_sizes_ranges_owner_and_local_index(vocab, world):
    plan = ShardPlan(vocab, world, "contiguous")
    sizes = plan.sizes
    assert len(sizes) == world and sum(sizes) == vocab and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra rows sit on the first ranks
    assert plan.max_shard_size == max(sizes)
    b = plan.boundaries
    assert b[0] == 0 and b[-1] == vocab and all(plan.shard_range(r) == (b[r], b[r + 1]) for r in range(world))
    assert [plan.shard_size(r) for r in range(world)] == sizes
    ids = torch.arange(vocab)
    owners, local = plan.owner(ids), plan.local_index(ids)
    for i in range(vocab):
        start, end = plan.shard_range(int(owners[i]))
        assert start <= i < end and int(local[i]) == i - start
    # round trip: (owner, local row) -> id
    starts = torch.tensor(b[:-1], dtype=torch.long)
    assert torch.equal(starts[owners] + local, ids)
    if vocab < world:
        assert sizes.count(0) == world - vocab


def test_owner_of_int32_and_shaped_ids():
    plan = ShardPlan(11, 3, "contiguous")  # 4, 4, 3
    ids = torch.tensor([[0, 3, 4], [7, 8, 10]], dtype=torch.int32)
    assert plan.owner(ids).tolist() == [[0, 0, 1], [1, 2, 2]]
    assert plan.local_index(ids).tolist() == [[0, 3, 0], [3, 0, 2]]


def test_fingerprint_and_errors():
    assert ShardPlan(11, 3).fingerprint() == ShardPlan(11, 3).fingerprint()
    assert len({ShardPlan(11, 3).fingerprint(), ShardPlan(12, 3).fingerprint(), ShardPlan(11, 2).fingerprint()}) == 3
    with pytest.raises(ValueError, match="num_embeddings"):
        ShardPlan(-1, 2)
    with pytest.raises(ValueError, match="world_size"):
        ShardPlan(5, 0)
    with pytest.raises(ValueError, match="rank 3 outside world of size 3"):
        ShardPlan(5, 3).shard_range(3)
