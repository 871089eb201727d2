"""A rank's rows of fairseq's initial table, drawn in chunks, equal the rows of the whole draw,
and the generator ends where the whole draw leaves it (what every later module's
initialisation depends on). The chunks are small here so that every table is drawn in
several, with ragged ends of every kind."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embrace_fairseq.core.initial_table import draw_chunks, fairseq_initial_rows, fairseq_initial_table
from embrace_fairseq.core.shard_plan import ShardPlan

SHAPES = [(7, 2), (51, 3), (100, 16), (257, 5), (1001, 24)]


@pytest.mark.parametrize("vocab,dim", SHAPES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_rows_equal_the_whole_draw_and_the_generator_follows(vocab, dim, world, layout):
    plan = ShardPlan(vocab, world, layout)
    torch.manual_seed(11)
    full = fairseq_initial_table(vocab, dim, padding_idx=1)
    after_full = torch.rand(4)
    for rank in range(world):
        torch.manual_seed(11)
        rows = fairseq_initial_rows(vocab, dim, 1, plan.vocab_ids(rank), chunk_elems=40)
        assert torch.equal(rows, plan.shard_rows(full, rank)), (rank, vocab, dim)
        assert torch.equal(torch.rand(4), after_full)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes(dtype):
    torch.manual_seed(3)
    full = fairseq_initial_table(257, 5, None, dtype)
    torch.manual_seed(3)
    ids = torch.arange(2, 257, 3)
    assert torch.equal(fairseq_initial_rows(257, 5, None, ids, dtype, chunk_elems=64), full[ids])


def test_chunks_are_whole_blocks_but_the_last_which_has_one_at_least():
    for vocab, dim, elems in [(1001, 24, 100), (257, 5, 40), (7, 2, 40), (17, 1, 16), (33, 1, 16)]:
        bounds = draw_chunks(vocab, dim, elems)
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all((e - s) * dim % 16 == 0 for s, e in bounds[:-1]), bounds
        assert (bounds[-1][1] - bounds[-1][0]) * dim >= min(16, vocab * dim), bounds


class _LargestRows(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                self.rows = max(self.rows, t.shape[0])
        return out


def test_a_rank_never_holds_the_table():
    vocab, dim, world = 250_007, 8, 4
    ids = ShardPlan(vocab, world, "strided").vocab_ids(1)
    with _LargestRows() as seen:
        rows = fairseq_initial_rows(vocab, dim, 1, ids, chunk_elems=1 << 16)
    assert rows.shape == (62_502, dim)
    assert seen.rows == 62_502, seen.rows  # the shard itself; each chunk holds 8,192 rows


def test_ids_must_ascend():
    with pytest.raises(ValueError, match="ascending"):
        fairseq_initial_rows(10, 2, None, torch.tensor([3, 1]))
