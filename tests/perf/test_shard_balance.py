"""The balanced layout spreads the exchange: on real fairseq batches the busiest owner
carries at most 1.15x the mean owner's rows (forward) and gradient rows (backward) at
2, 4 and 8 ranks, where contiguous ranges load rank 0 far more; and the counts are
exactly the bytes the exchange records."""
import pytest
import torch

from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.perf import shard_balance as SB
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_layouts as fns

WORLDS = (2, 4, 8)


@pytest.fixture(scope="module")
def result():
    return SB.measure(SB.batch_source(None), worlds=WORLDS, steps=20)


def test_strided_meets_the_goal(result):
    for world in WORLDS:
        for phase in SB.PHASES:
            b = result["layouts"]["strided"][str(world)][phase]
            assert b["owners_max_over_mean"] <= SB.GOAL, (world, phase, b)
            assert b["owners_run_total_max_over_mean"] <= SB.GOAL, (world, phase, b)


def test_contiguous_is_worse(result):
    for world in WORLDS:
        for phase in SB.PHASES:
            c = result["layouts"]["contiguous"][str(world)][phase]["owners_max_over_mean"]
            s = result["layouts"]["strided"][str(world)][phase]["owners_max_over_mean"]
            assert c >= 1.5 and c > s + 0.3, (world, phase, c, s)


def test_same_total_volume_both_layouts(result):
    # the layout moves the load between ranks, it hardly changes the total
    for world in WORLDS:
        a = result["layouts"]["strided"][str(world)]["rows"]["mean_bytes_per_step"]
        b = result["layouts"]["contiguous"][str(world)]["rows"]["mean_bytes_per_step"]
        assert abs(a - b) <= 0.05 * b, (world, a, b)


def test_table_prints(result):
    text = SB.table(result)
    assert "| strided | 8 | grad_rows |" in text and "| contiguous | 2 | rows |" in text


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_counts_are_what_the_exchange_records(layout):
    vocab, dim, world = 37, 3, 3
    w = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.0)
    ids = [torch.multinomial(w, 40, replacement=True, generator=torch.Generator().manual_seed(r)).view(5, 8)
           for r in range(world)]
    ids[2] = ids[2][:0]  # an empty batch
    predicted = SB.step_bytes(ids, ShardPlan(vocab, world, layout), dim * 4)
    recorded = run_ranks(fns.bytes_of_one_step, world, vocab, dim, layout, ids)
    for r in range(world):
        for phase in SB.PHASES:
            assert recorded[r][phase] == (predicted.sent[phase][r], predicted.received[phase][r]), (r, phase)
