"""An ``auto`` tied output layer with the table overlap on starts the full table's
all-gather at a step's first lookup only when that step's loss takes the gather path
(real gloo ranks, bytes from the ledger): a step that goes vocab-parallel after a gather
step sends no ``V x D`` table and holds none beside its ``M x V/N`` logits, and a gather
step after a vocab-parallel one still has its gather started at the lookup."""
import pytest

import rank_fns_output_prefetch as fns
from embrace_fairseq.core.vocab_parallel import GATHER, VOCAB_PARALLEL, output_bytes
from embrace_fairseq.tools.local_ranks import run_ranks

MANY, FEW = 600, 4


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_prefetches_only_the_table_it_reads(world):
    cost = output_bytes(fns.VOCAB, fns.DIM, [MANY] * world, smoothing=False)
    assert cost.choose() == GATHER and output_bytes(fns.VOCAB, fns.DIM, [FEW] * world, smoothing=False).choose() == VOCAB_PARALLEL
    steps = [MANY, FEW, MANY, MANY, FEW]
    res = run_ranks(fns.auto_steps, world, steps, timeout_s=240)
    for per_rank in res:
        assert [s["choice"] for s in per_rank] == [GATHER, VOCAB_PARALLEL, GATHER, GATHER, VOCAB_PARALLEL]
        for s in per_rank:
            # the gather steps' table (its all-gather only: the gradient is table_grad)
            assert (s["table_gather"] > 0) == (s["choice"] == GATHER), per_rank
        # after a vocab-parallel step (and after any step once the path is known) the
        # lookup starts exactly the gather the step reads; the very first step decides at the loss
        assert [s["started_at_lookup"] for s in per_rank] == [False, False, True, True, False], per_rank
    gathered = [s["table_gather"] for s in res[0] if s["choice"] == GATHER]
    assert len(set(gathered)) == 1  # one table's all-gather a gather step, never two
