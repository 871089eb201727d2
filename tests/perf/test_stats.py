"""Paired-bootstrap intervals of step-time ratios (perf/bench/stats.py)."""
import random

import pytest

from embrace_fairseq.perf.bench.stats import (LEGACY_RATIO_STATISTIC, RATIO_STATISTIC, paired_ratio_interval, ratio_of,
                                            ratio_statistic)


def _paired(n, true_ratio, batch_spread, noise, seed=1):
    rng = random.Random(seed)
    batch = [1.0 + batch_spread * rng.random() for _ in range(n)]  # shared by both strategies
    den = [b * (1 + noise * rng.gauss(0, 1)) for b in batch]
    num = [true_ratio * b * (1 + noise * rng.gauss(0, 1)) for b in batch]
    return num, den


def test_interval_holds_the_ratio_and_narrows_with_more_steps():
    wide = paired_ratio_interval(*_paired(10, 1.3, 0.5, 0.03))
    narrow = paired_ratio_interval(*_paired(200, 1.3, 0.5, 0.03))
    for r in (wide, narrow):
        assert r["low"] <= r["ratio"] <= r["high"]
        assert r["low"] < 1.3 < r["high"] or abs(r["ratio"] - 1.3) < 0.02
    assert narrow["high"] - narrow["low"] < wide["high"] - wide["low"]
    assert narrow["steps"] == 200


def test_pairing_cancels_the_batch_to_batch_variation():
    num, den = _paired(40, 1.1, 1.0, 0.01)
    paired = paired_ratio_interval(num, den)
    # the same step times with the pairing destroyed: the batch spread is no longer shared
    shuffled = list(num)
    random.Random(3).shuffle(shuffled)
    unpaired = paired_ratio_interval(shuffled, den)
    assert paired["high"] - paired["low"] < 0.5 * (unpaired["high"] - unpaired["low"])
    assert paired["low"] > 1.0  # 10 % apart is resolved when paired


def test_no_difference_gives_an_interval_around_one():
    num, den = _paired(60, 1.0, 0.5, 0.05, seed=7)
    r = paired_ratio_interval(num, den)
    assert r["low"] < 1.0 < r["high"]


def test_reproducible_and_checked():
    num, den = _paired(30, 1.2, 0.3, 0.05)
    assert paired_ratio_interval(num, den) == paired_ratio_interval(num, den)
    assert ratio_of([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], "median") == 2.0
    with pytest.raises(ValueError, match="no paired steps"):
        paired_ratio_interval([], [1.0])


def test_the_mean_ratio_is_the_throughput_ratio_and_the_median_is_kept_for_old_results():
    num, den = [2.0, 2.0, 8.0], [1.0, 1.0, 1.0]
    # three batches: the baseline took 12 s, the subject 3 s: 4x the throughput
    assert paired_ratio_interval(num, den, statistic="mean")["ratio"] == pytest.approx(4.0)
    assert paired_ratio_interval(num, den, statistic="median")["ratio"] == pytest.approx(2.0)
    # new results: the geometric mean of the paired ratios (2 * 2 * 8) ** (1/3)
    assert paired_ratio_interval(num, den)["ratio"] == pytest.approx(32 ** (1 / 3))
    assert ratio_statistic({}) == LEGACY_RATIO_STATISTIC == "median"
    assert ratio_statistic({"ratio_statistic": RATIO_STATISTIC}) == "geomean"
    with pytest.raises(ValueError, match="unknown ratio statistic"):
        paired_ratio_interval(num, den, statistic="mode")


def test_the_mean_ratios_interval_narrows_where_the_medians_is_ragged():
    # a dozen steps with scheduling noise: the median's bootstrap takes a few values only
    num, den = _paired(12, 1.2, 0.2, 0.08, seed=5)
    mean, median = (paired_ratio_interval(num, den, statistic=s) for s in ("mean", "median"))
    for r in (mean, median):
        assert r["low"] <= r["ratio"] <= r["high"]
    assert mean["high"] - mean["low"] < median["high"] - median["low"]


def test_the_log_t_interval_matches_its_formula_and_keeps_its_coverage_at_eight_steps():
    import math
    import statistics

    from scipy.stats import t

    from embrace_fairseq.perf.bench.stats import INTERVAL_METHODS, interval_method, log_t_interval

    num, den = [1.9, 2.3, 2.0, 2.2, 1.8, 2.1, 2.4, 2.0], [1.0, 1.1, 0.9, 1.0, 1.0, 1.05, 1.1, 0.95]
    logs = [math.log(a / b) for a, b in zip(num, den)]
    half = t.ppf(0.975, 7) * statistics.stdev(logs) / math.sqrt(8)
    r = log_t_interval(num, den)
    assert r["steps"] == 8 and r["ratio"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (r["low"], r["high"]) == pytest.approx((math.exp(statistics.fmean(logs) - half),
                                                   math.exp(statistics.fmean(logs) + half)))
    # coverage of the true ratio over many 8-step runs with log-normal step noise: about 95 %
    rng = random.Random(11)
    covered = 0
    for _ in range(400):
        den = [math.exp(rng.gauss(0, 0.1)) for _ in range(8)]
        num = [1.3 * d * math.exp(rng.gauss(0, 0.08)) for d in den]
        iv = log_t_interval(num, den)
        covered += iv["low"] <= 1.3 <= iv["high"]
    assert 0.91 <= covered / 400 <= 0.99
    # where the bootstrap can only return the per-step ratios' range, the t interval is wider
    few_num, few_den = [2.17, 1.69, 1.9], [1.0, 1.0, 1.0]
    boot = paired_ratio_interval(few_num, few_den, statistic="mean")
    tint = log_t_interval(few_num, few_den)
    assert tint["low"] < boot["low"] and tint["high"] > boot["high"]
    assert interval_method({"ratio_statistic": "geomean"}) == INTERVAL_METHODS["geomean"]
    assert "bootstrap" in interval_method({})
