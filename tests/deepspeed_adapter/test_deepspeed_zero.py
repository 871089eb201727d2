"""EmbRace under DeepSpeed ZeRO stage 1 against stock DeepSpeed ZeRO stage 1, and the
global non-finite gradient check, in real gloo ranks."""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_deepspeed as R  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402
from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer  # noqa: E402

RTOL = 1e-4


_rel = R.rel_diff


@pytest.mark.slow
def test_zero1_matches_stock_zero1():
    """10 steps on 2 ranks: client Adam + clipping, AdamW + WarmupLR from the config,
    SGD with momentum and weight decay (untied): losses and gathered weights within 1e-4."""
    results = run_ranks(R.zero1_run, 2, 10, timeout_s=300, pg_timeout_s=120)
    for rank, res in enumerate(results):
        for variant in ("adam", "adamw_sched", "sgd_untied"):
            ref, got = res[(variant, False)], res[(variant, True)]
            assert len(got["losses"]) == 10
            assert _rel(got["losses"], ref["losses"]) < RTOL, (rank, variant, got["losses"], ref["losses"])
            for name in ref["state"]:
                assert _rel(got["state"][name], ref["state"][name]) < RTOL, (rank, variant, name)
            # the weights really moved (the comparison is not between two untrained models)
            assert _rel(got["state"]["emb.weight"], R.TinyLM(False, True).full_state()["emb.weight"]) > 1e-3


@pytest.mark.slow
def test_bf16_zero1_matches_stock_within_bf16_rounding():
    """bf16 + ZeRO-1 on CPU: losses within 2% and weights within 2% relative of stock
    DeepSpeed after 10 steps (bf16 has 8 mantissa bits: one ulp is 0.4-0.8% relative;
    the two runs differ in summation order and where rounding to bf16 happens)."""
    results = run_ranks(R.bf16_run, 2, 10, timeout_s=400, pg_timeout_s=120)
    for rank, res in enumerate(results):
        ref, got = res[False], res[True]
        assert _rel(got["losses"], ref["losses"]) < 2e-2, (rank, got["losses"], ref["losses"])
        for name in ref["state"]:
            assert _rel(got["state"][name], ref["state"][name]) < 2e-2, (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_nonfinite_gradient_stops_every_rank(stage):
    """A NaN in the last rank's shard gradient: every rank raises FloatingPointError naming it."""
    results = run_ranks(R.nonfinite_run, 2, stage, timeout_s=200, pg_timeout_s=60)
    for res in results:
        assert res["error"] is not None and res["isfpe"], res
        assert "emb.weight on rank 1" in res["error"], res["error"]


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_row_subset_steps_equal_one_full_step(kind):
    """Element-wise rules: a step on rows A then on the complement == one step on all rows."""
    torch.manual_seed(0)
    w = torch.randn(11, 4)
    grads = [torch.randn(11, 4) for _ in range(3)]
    hp = HyperParams(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, momentum=0.9)
    full_p, split_p = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    full, split = ShardOptimizer([full_p], kind), ShardOptimizer([split_p], kind)
    a = torch.tensor([0, 3, 4, 9])
    b = torch.tensor([i for i in range(11) if i not in a.tolist()])
    for g in grads:
        full_p.grad, split_p.grad = g.clone(), g.clone()
        full.step(hp)
        split.begin_step(hp)
        split.apply([a])
        split.apply([b])
    assert torch.allclose(full_p, split_p, rtol=0, atol=1e-7)
    # and it is torch's rule
    ref_p = torch.nn.Parameter(w.clone())
    ref = {"adam": lambda: torch.optim.Adam([ref_p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05),
           "adamw": lambda: torch.optim.AdamW([ref_p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05),
           "sgd": lambda: torch.optim.SGD([ref_p], lr=0.1, momentum=0.9, weight_decay=0.05)}[kind]()
    for g in grads:
        ref_p.grad = g.clone()
        ref.step()
    assert torch.allclose(full_p, ref_p, rtol=1e-6, atol=1e-6)
