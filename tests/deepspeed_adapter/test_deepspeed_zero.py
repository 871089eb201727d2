"""EmbRace under DeepSpeed ZeRO stage 1 against stock DeepSpeed ZeRO stage 1, and the
global non-finite gradient check, in real gloo ranks."""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_deepspeed as R  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402

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


@pytest.mark.parametrize("stage", [0, 1])
def test_nonfinite_gradient_stops_every_rank(stage):
    """A NaN in the last rank's shard gradient: every rank raises FloatingPointError naming it."""
    results = run_ranks(R.nonfinite_run, 2, stage, timeout_s=200, pg_timeout_s=60)
    for res in results:
        assert res["error"] is not None and res["isfpe"], res
        assert "emb.weight on rank 1" in res["error"], res["error"]


# ---------------------------------------------------------------- ZeRO stage 2 (and 3)
import rank_fns_zero2 as Z2  # noqa: E402


def _assert_zero2_matches(results, cases, steps, rtol=RTOL):
    """Every rank: EmbRace ZeRO-2 gives stock ZeRO-2's losses, global norms and weights
    within 1e-4; DeepSpeed never held the shard (not in its optimizer, no gradient hook);
    its own reducer partitioned the dense gradients; rank 0 said so once per engine."""
    for rank, res in enumerate(results):
        for case in cases:
            ref, got = res[(case, False)], res[(case, True)]
            gas = Z2.CASES[case][2]
            assert len(got["losses"]) == steps * gas and len(got["norms"]) == steps
            assert _rel(got["losses"], ref["losses"]) < rtol, (rank, case, got["losses"], ref["losses"])
            assert _rel(got["norms"], ref["norms"]) < rtol, (rank, case, got["norms"], ref["norms"])
            for name in ref["state"]:
                assert _rel(got["state"][name], ref["state"][name]) < rtol, (rank, case, name)
            # the weights really moved (not a comparison between two untrained models)
            assert _rel(got["state"]["emb.weight"], R.TinyLM(False, True).full_state()["emb.weight"]) > 1e-3
            facts = got["facts"]
            assert facts["shards"] == 1 and facts["in_optimizer"] == 0 and facts["hooked"] == 0, facts
            assert facts["partition_gradients"] and facts["hook_reducer"] is None, facts
            # stock hooks the replicated table too: one more hooked parameter
            assert ref["facts"]["dense_hooked"] == facts["dense_hooked"] + 1, (ref["facts"], facts)
        assert len(res["log"]) == (len(cases) if rank == 0 else 0), res["log"]
        if res["log"]:
            assert "ZeRO stage 2" in res["log"][0] and "does not apply" in res["log"][0]
        assert res["stage3"] is not None and "Use stage 2" in res["stage3"] and "\n" not in res["stage3"], res["stage3"]


def test_zero2_matches_stock_zero2():
    """2 ranks, 3 steps: a tied table with clipping and accumulation 2 (client Adam), and
    an untied one with clipping and accumulation 2 (SGD with momentum): same losses,
    global norms and weights as stock DeepSpeed ZeRO-2; ZeRO-3 refused on every rank."""
    cases = ("tied_clip_gas2", "untied_sgd_gas2")
    _assert_zero2_matches(run_ranks(Z2.zero2_run, 2, cases, 3, timeout_s=300, pg_timeout_s=120), cases, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_zero2_matches_stock_zero2_every_case(world):
    """2 and 3 ranks (the vocabulary of 37 divides neither), 6 steps of every case: also
    AdamW with a warm-up schedule from the config and a tied table without clipping."""
    cases = tuple(Z2.FP32_CASES)
    _assert_zero2_matches(run_ranks(Z2.zero2_run, world, cases, 6, timeout_s=600, pg_timeout_s=180), cases, 6)


@pytest.mark.slow
def test_bf16_zero2_matches_stock_within_bf16_rounding():
    """bf16 + ZeRO-2 on CPU, 2 ranks, 6 steps (tied with accumulation 2, untied), with
    clipping: losses, norms and weights within 2% relative of stock DeepSpeed (bf16 has
    8 mantissa bits; the two runs round in different places, as at ZeRO-1)."""
    cases = tuple(Z2.BF16_CASES)
    _assert_zero2_matches(run_ranks(Z2.zero2_run, 2, cases, 6, timeout_s=600, pg_timeout_s=180), cases, 6, rtol=2e-2)


@pytest.mark.parametrize("where, name, bf16", [("shard", "emb.weight", False), ("dense", "fc2.weight", False),
                                               ("dense", "fc2.weight", True)])
def test_zero2_nonfinite_gradient_stops_every_rank(where, name, bf16):
    """ZeRO-2, a NaN in the last rank's shard (or dense) gradient at the second step:
    every rank raises FloatingPointError naming the parameter before any weight changes
    (a dense gradient is named on the rank whose partition holds it); also in bf16."""
    results = run_ranks(Z2.nonfinite_zero2_run, 2, where, 1, bf16, timeout_s=200, pg_timeout_s=60)
    for res in results:
        assert res["error"] is not None and res["isfpe"], res
        assert name in res["error"] and res["unchanged"], res
    if where == "shard":
        assert "emb.weight on rank 1" in results[0]["error"]


def test_zero3_refusal_says_why_and_what_instead():
    from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError, check_supported

    with pytest.raises(EmbraceConfigError) as err:
        check_supported({"zero_optimization": {"stage": 3}})
    msg = str(err.value)
    assert "stage 3" in msg and "partitioned by rows" in msg and "Use stage 2" in msg and "\n" not in msg
    for stage in (0, 1, 2):
        check_supported({"zero_optimization": {"stage": stage}})


def test_relaxed_embedding_under_zero2_matches_stock():
    """"relaxed_embedding": true at ZeRO-2 (the deferred rows stepped by the shard
    optimizer while DeepSpeed partitions the dense gradients), 2 ranks, 5 steps, tied and
    untied: stock DeepSpeed's losses and weights within 1e-4."""
    for rank, res in enumerate(run_ranks(Z2.relaxed_zero2_run, 2, 5, timeout_s=400, pg_timeout_s=120)):
        for tied in (False, True):
            ref, got = res[("stock", tied)], res[("relaxed", tied)]
            assert _rel(got["losses"], ref["losses"]) < RTOL, (rank, tied, got["losses"], ref["losses"])
            for name in ref["state"]:
                assert _rel(got["state"][name], ref["state"][name]) < RTOL, (rank, tied, name)
