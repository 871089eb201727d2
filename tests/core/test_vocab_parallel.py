"""Vocab-parallel output projection + loss against the single-process full-table reference."""
import pytest

from embrace_fairseq.core.vocab_parallel import AUTO, GATHER, VOCAB_PARALLEL, OutputChooser, output_bytes
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_vocab_parallel as fns

TOL = 1e-5
VOCAB, DIM = 11, 5  # 11 rows: uneven over 2 and 3 ranks


CASES = [
    # (vocab, dim, token counts per rank, label smoothing, layout)
    (VOCAB, DIM, [6, 3, 8], 0.0, "contiguous"),
    (VOCAB, DIM, [6, 3, 8], 0.1, "contiguous"),
    (VOCAB, DIM, [4, 0, 5], 0.1, "contiguous"),  # a rank without tokens
    (VOCAB, DIM, [0, 4, 5], 0.0, "contiguous"),
    (VOCAB, DIM, [5, 2, 7], 0.1, "strided"),  # the function takes its rows' ids: any layout
    (2, DIM, [3, 1, 2], 0.1, "contiguous"),  # V=2 over 3 ranks: a rank holds no rows
    (VOCAB, DIM, [4, 4, 4], 0.1, "strided"),  # as many tokens everywhere: the all-gather, not the AlltoAll
]


@pytest.mark.parametrize("world,defer", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_matches_full_table(world, defer):
    """``defer``: the table's gradient is left owed by the backward (the hidden states'
    is not) and computed at the flush; the same gradients."""
    results = run_ranks(fns.compare_cases, world, CASES, defer)
    for case_index, case in enumerate(CASES):
        per_rank = [r[case_index] for r in results]
        for rank, r in enumerate(per_rank):
            where = f"world={world} case={case} rank={rank}"
            for key in ("loss", "nll", "dh", "dw"):
                assert r[key] < TOL, (where, key, r)
            assert r["correct"][0] == r["correct"][1], (where, r["correct"])
            if defer and sum(case[2][:world]):
                assert r["owed"] == (1, True, True), (where, r["owed"])
        if world > 1 and case[4] == "contiguous":
            # the estimate the choice uses is what the busiest rank records
            kinds = ("hidden_gather", "hidden_grad", "softmax_stats")
            busiest = max(sum(r["bytes"].get(k, 0) for k in kinds) for r in per_rank)
            est = per_rank[0]["estimate"]
            assert abs(busiest - est) <= 0.02 * est + 64, (case, busiest, est)
    if world > 1:  # no tokens on any rank: no collective, zero loss, gradients defined
        assert [r[len(CASES)] for r in results] == [(0.0, 0)] * world


def test_cost_and_choice():
    # translation shape: d=256, V=8k, 2048 tokens per rank
    two = output_bytes(8000, 256, [2048, 2048])
    four = output_bytes(8000, 256, [2048] * 4)
    assert two.gather_bytes == 2 * 4000 * 256 * 4
    # N*T = 4096 < V on 2 ranks: activations are cheaper; 8192 > V on 4 ranks: the table is
    assert two.choose(AUTO) == VOCAB_PARALLEL and four.choose(AUTO) == GATHER
    assert two.vocab_parallel_bytes < 0.55 * two.gather_bytes
    few = output_bytes(8000, 256, [512, 512])
    assert few.choose(AUTO) == VOCAB_PARALLEL
    assert few.choose(GATHER) == GATHER and four.choose(VOCAB_PARALLEL) == VOCAB_PARALLEL
    assert output_bytes(8000, 256, [100]).choose(AUTO) == GATHER  # one rank: nothing moves either way
    chooser = OutputChooser(AUTO)
    assert [chooser.choose(c) for c in (few, few, four)] == [VOCAB_PARALLEL, VOCAB_PARALLEL, GATHER]
    assert chooser.steps == {GATHER: 1, VOCAB_PARALLEL: 2}
    with pytest.raises(ValueError):
        OutputChooser("sometimes")


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_translation_shape(world):
    """d=256, V=8000, 2048 tokens per rank: bytes sent per rank per step by each path, from
    the ledger, against the estimate the automatic choice uses."""
    vocab, dim, tokens = 8000, 256, 2048
    res = run_ranks(fns.ledger_bytes_per_step, world, vocab, dim, tokens, timeout_s=600)
    gather = max(sum(r["gather"].values()) for r in res)
    vp = max(sum(r["vocab-parallel"].values()) for r in res)
    est = output_bytes(vocab, dim, [tokens] * world)
    print(f"\n{world} ranks: gather {gather} B ({res[0]['gather']}), vocab-parallel {vp} B ({res[0]['vocab-parallel']}); "
          f"estimate gather {est.gather_bytes}, vocab-parallel {est.vocab_parallel_bytes}")
    assert abs(gather - est.gather_bytes) <= 0.01 * est.gather_bytes
    assert abs(vp - est.vocab_parallel_bytes) <= 0.01 * est.vocab_parallel_bytes
    assert (vp < gather) == (world == 2)


@pytest.mark.parametrize("mode", ["bf16_autocast", "bf16"])
def test_half_precision_against_float64(mode):
    """One process (no peer): under CPU bf16 autocast, and with bf16 weights and hidden
    states, the loss and gradients stay within bf16 rounding of the float64 full-table
    loss; the gradients come back in the inputs' dtypes."""
    import torch
    import torch.nn.functional as F

    from embrace_fairseq.core.vocab_parallel import VocabShardSpec, label_smoothed_loss, vocab_parallel_loss

    g = torch.Generator().manual_seed(5)
    V, D, T, eps = 301, 32, 97, 0.1
    table, hidden = torch.randn(V, D, generator=g) * 0.3, torch.randn(T, D, generator=g)
    target = torch.randint(0, V, (T,), generator=g)
    w64, h64 = table.double().requires_grad_(), hidden.double().requires_grad_()
    lp = F.log_softmax(h64 @ w64.t(), dim=-1)
    ref = label_smoothed_loss(-lp.gather(1, target[:, None]).sum(), -lp.sum(), eps, V)
    ref.backward()
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    w, h = table.to(dtype).requires_grad_(), hidden.to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16_autocast"):
        res = vocab_parallel_loss(h, w, target, VocabShardSpec(rows=torch.arange(V), vocab_size=V), smoothing=True)
        loss = label_smoothed_loss(res.nll.sum(), res.smooth.sum(), eps, V)
    loss.backward()
    assert w.grad.dtype == dtype and h.grad.dtype == dtype
    assert abs(float(loss) - float(ref)) <= 2e-2 * abs(float(ref))
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert float((got.double() - want).abs().max()) <= 3e-2 * float(want.abs().max())
    # the float32 path without autocast is exact to float32 rounding
    w32, h32 = table.clone().requires_grad_(), hidden.clone().requires_grad_()
    res = vocab_parallel_loss(h32, w32, target, VocabShardSpec(rows=torch.arange(V), vocab_size=V), smoothing=True)
    assert abs(float(label_smoothed_loss(res.nll.sum(), res.smooth.sum(), eps, V)) - float(ref)) <= 1e-5 * abs(float(ref))


def test_second_backward_through_one_graph_gives_the_same_gradients():
    """The backward only reads the kept numerators (the logits buffer is overwritten
    once, in forward): a second backward through the same graph (``retain_graph``)
    adds the same gradients again."""
    import torch

    from embrace_fairseq.core.vocab_parallel import VocabShardSpec, vocab_parallel_loss

    h, w = torch.randn(5, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    res = vocab_parallel_loss(h, w, torch.randint(0, 7, (5,)), VocabShardSpec(rows=torch.arange(7), vocab_size=7),
                              smoothing=True)
    loss = res.nll.sum() + 0.1 * res.smooth.sum()
    loss.backward(retain_graph=True)
    gh, gw = h.grad.clone(), w.grad.clone()
    loss.backward()
    assert torch.allclose(h.grad, 2 * gh) and torch.allclose(w.grad, 2 * gw)


def test_deferred_table_gradient_with_extra_columns():
    """A bias's rows as extra columns (RoBERTa's head): deferred, the backward leaves the
    extra columns' gradient (a dense parameter's) and the hidden states' in place and
    owes only the table's; after the flush every gradient equals the eager backward's."""
    import torch

    from embrace_fairseq.core.deferred_grad import DeferredGrads
    from embrace_fairseq.core.vocab_parallel import VocabShardSpec, vocab_parallel_loss

    g = torch.Generator().manual_seed(3)
    h0, w0, b0 = torch.randn(6, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, 1, generator=g)
    target = torch.randint(0, 9, (6,), generator=g)
    grads = {}
    for defer in (False, True):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        deferred = DeferredGrads() if defer else None
        spec = VocabShardSpec(rows=torch.arange(9), vocab_size=9, grad_scale=0.5, deferred=deferred)
        res = vocab_parallel_loss(torch.cat([h, torch.ones(6, 1)], dim=1), w, target, spec, smoothing=True, extra=b)
        (res.nll.sum() + 0.1 * res.smooth.sum()).backward()
        if defer:
            assert w.grad is None and b.grad is not None and h.grad is not None and len(deferred) == 1
            deferred.flush()
            assert len(deferred) == 0
        grads[defer] = (h.grad, w.grad, b.grad)
    for eager, late in zip(grads[False], grads[True]):
        assert torch.allclose(eager, late, atol=1e-6)
    with pytest.raises(ValueError, match="hidden of width"):
        vocab_parallel_loss(h0, w0, target, VocabShardSpec(rows=torch.arange(9), vocab_size=9), extra=b0)


def test_token_counts_prefetched_before_the_forward():
    """The criterion starts the token counts' all-gather before the forward: the loss
    gets the same counts, losses and gradients as when it gathers them itself, and a
    count that differs from the loss's positions stops with a message."""
    results = run_ranks(fns.prefetched_counts, 2)
    for counts, same, error in results:
        assert counts == [3, 5] and same
        assert "announced to the other ranks" in error


@pytest.mark.parametrize("vocab,world", [(11, 1), (11, 2), (11, 3), (2, 3), (250_002, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_local_columns_equal_a_full_map_of_the_rows(vocab, world, layout):
    """The binary search over a shard's ascending rows finds what a vocabulary-long map of
    them finds, on every rank of both layouts (empty shards and other ranks' ids too)."""
    import torch

    from embrace_fairseq.core.shard_plan import ShardPlan
    from embrace_fairseq.core.vocab_parallel import local_columns

    plan = ShardPlan(vocab, world, layout=layout)
    target = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (257,), generator=torch.Generator().manual_seed(0))])
    for rank in range(world):
        rows = plan.vocab_ids(rank)
        full = torch.full((vocab,), -1, dtype=torch.long)
        full[rows] = torch.arange(rows.numel())
        assert torch.equal(local_columns(target, rows), full[target])
        assert torch.equal(local_columns(target.int(), rows), full[target])
