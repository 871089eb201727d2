"""The workloads' shapes against the released models they are named after, and the buckets
scaled with them (pure arithmetic, plus fairseq building the two small named models)."""
from pathlib import Path

import pytest

from embrace_fairseq.perf.bench import large_vocab as LV
from embrace_fairseq.perf.bench import regime_goals as G
from embrace_fairseq.perf.bench import shapes as SH
from embrace_fairseq.perf.bench import workloads as W


def test_real_models_counted_from_their_published_dims():
    # GPT-2 small: wte 50257x768 + wpe 1024x768 + 12 blocks of 7,087,872 + ln_f: the 124M of its release
    gpt = SH.REAL["gpt_lm"]
    assert gpt.parameters == 50257 * 768 + 1024 * 768 + 12 * 7_087_872 + 2 * 768 == 124_439_808
    assert gpt.embedding_share == pytest.approx(0.310, abs=0.001)
    # transformer_base (WMT en-de): 6+6 post-norm layers d512 ffn2048, one 32,768-row table
    base = SH.REAL["translation"]
    enc = 4 * (512 * 512 + 512) + (512 * 2048 + 2048) + (2048 * 512 + 512) + 2 * 2 * 512
    dec = enc + 4 * (512 * 512 + 512) + 2 * 512
    assert base.parameters == 32768 * 512 + 6 * enc + 6 * dec
    assert base.embedding_share == pytest.approx(0.2754, abs=0.0005)
    assert {k: round(r.embedding_share, 3) for k, r in SH.REAL.items()} == {
        "translation": 0.275, "gpt_lm": 0.31, "xlmr": 0.69, "mbart": 0.419, "m2m": 0.271}


@pytest.mark.parametrize("name", sorted(SH.REAL))
def test_named_workloads_keep_the_vocabulary_and_the_share(name):
    shape = W.workload_shape(name)
    assert not shape["synthetic"]
    assert shape["vocab"] == shape["real_vocab"] == SH.REAL[name].shape.vocab
    assert abs(shape["share_gap_points"]) <= 100 * SH.SHARE_TOLERANCE
    assert shape["tokens_per_rank"] == SH.REAL[name].tokens_per_gpu or shape["tokens_note"]


@pytest.mark.parametrize("name", sorted(SH.SYNTHETIC))
def test_synthetic_workloads_are_named_so_and_carry_no_goal(name):
    shape = W.workload_shape(name)
    assert shape["synthetic"] and shape["synthetic_reason"] and "real_model" not in shape
    assert name not in G.SPEEDUP_TARGETS
    result = {"runs": [{"model": name, "world_size": 2, "regime": "v100-25g"}],
              "ratio_intervals": {f"{name}/w2/v100-25g": {"fairseq_c10d": {"ratio": 0.5, "low": 0.4, "high": 0.6}}}}
    assert G.regime_goal_check(result) == []


def test_ffn_solved_for_a_share():
    s = LV.Shape(32768, 64, 2, 2, 0)
    for share in (0.2, 0.275, 0.5):
        f = SH.ffn_for_share(s, share, multiple=8)
        assert abs(LV.embedding_share(LV.Shape(32768, 64, 2, 2, f)) - share) < 0.002
    with pytest.raises(ValueError, match="strictly between"):
        SH.ffn_for_share(s, 1.0)
    with pytest.raises(ValueError, match="already has share"):
        SH.ffn_for_share(LV.Shape(10, 64, 2, 2, 0), 0.9)


def test_bucket_scale_is_the_gradient_bytes_ratio():
    assert SH.bucket_scale(1_000, 4_000) == pytest.approx(4 * 1_000 / (2 * 4_000))
    b = SH.scaled_buckets(1_000_000, 50_000_000)
    assert b["scale"] == pytest.approx(0.04)
    assert b["ddp_bucket_cap_mb"] == pytest.approx(25 * 0.04)
    assert b["ddp_first_bucket_mb"] == pytest.approx(0.04)
    assert b["embrace_bucket_mb"] == pytest.approx(4 * 0.04) and b["embrace_piece_mb"] == pytest.approx(0.04)
    # ZeRO's buckets are elements: 5e8 real (fp16) elements hold 1e9 bytes; 4 % of that in fp32 elements
    assert b["zero_reduce_bucket_size"] == b["zero_allgather_bucket_size"] == int(5e8 * 2 * 0.04 / 4)
    unscaled = SH.scaled_buckets(None, None)
    assert unscaled["scale"] == 1.0 and unscaled["ddp_bucket_cap_mb"] == 25 and "real_buckets" not in unscaled
    with pytest.raises(ValueError, match="positive"):
        SH.bucket_scale(0, 10)


@pytest.mark.parametrize("name", sorted(SH.REAL))
def test_every_named_workload_has_as_many_buckets_as_its_model(name):
    bench = LV.parameters(W.workload_dims(W.workloads(False)[name]))[1]
    b = SH.scaled_buckets(bench, SH.REAL[name].parameters)
    assert b["bench_buckets"] == b["real_buckets"]
    assert b["real_buckets"]["ddp"] >= 2  # a first bucket and at least one more: something to overlap


@pytest.mark.parametrize("name", ["translation", "gpt_lm"])
def test_fairseq_builds_the_counted_parameters(name, tmp_path):
    """The dims' count is what fairseq builds (a dictionary of the workload's rows)."""
    from fairseq.data import Dictionary

    w = W.workloads(False)[name]
    d = W.pad_rows(Dictionary(), w.vocab_rows)
    assert len(d) == w.vocab_rows
    task = W.BenchTask(source_dictionary=d, target_dictionary=d, dictionary=d)
    model = W.build_model(w, w.stock_arch, task, Path(tmp_path))
    assert sum(p.numel() for p in model.parameters()) == LV.parameters(W.workload_dims(w))[1]
    with pytest.raises(ValueError, match="more than"):
        W.pad_rows(d, 10)
