"""Intervals for ratios of step times measured side by side.

The strategies of a benchmark run step through the same batches (step ``i`` of every
strategy trains on batch ``i``), interleaved in rounds, so their step times are paired
by step: a bootstrap that resamples *step indices* keeps the pairing and with it the
batch-to-batch variation that both strategies share.

The statistic is the *geometric mean of the paired step ratios* ``num[i] / den[i]`` (equal
to the ratio of the two strategies' geometric-mean steps), and its interval a Student t
interval on their logarithms: ``exp(mean ± t(n-1) · sd / sqrt(n))`` of ``log(num[i] /
den[i])`` (:func:`log_t_interval`). A step time is a product of factors (the batch, the
machine's load), so the log ratio of a pair is close to normal and the t interval holds its
coverage at the 8 steps a cited run times, where a percentile bootstrap cannot: with n steps
it can only return values between the smallest and the largest resampled statistic, at 2-3
steps the min and max of the per-step ratios, narrower than any 95 % interval.

A results file names its statistic (``meta["ratio_statistic"]``) and its interval method
(``meta["interval_method"]``). Earlier files used the ratio of the *mean* step times (the
ratio of throughputs) or, before that was recorded, of the medians
(:data:`LEGACY_RATIO_STATISTIC`), each with a percentile bootstrap over paired steps; they
are read that way.
"""
from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Dict, Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000
# "No slower" is a non-inferiority claim: the interval's lower end must show the ratio is
# at most this far below 1.0. (Asking only that the upper end reach 1.0 would let a noisier
# measurement pass more easily.)
NO_WORSE_MARGIN = 0.03
#: how a ratio of two strategies' step times is formed from their paired steps
STATISTICS: Dict[str, Callable[[Sequence[float]], float]] = {"geomean": statistics.geometric_mean,
                                                              "mean": statistics.fmean,
                                                              "median": statistics.median}
#: what new results use: the geometric mean of the paired step ratios
RATIO_STATISTIC = "geomean"
#: each statistic's interval, as the reports name it
INTERVAL_METHODS = {"geomean": "Student t interval on the log paired step ratios (n - 1 degrees of freedom)",
                    "mean": "percentile bootstrap over paired steps", "median": "percentile bootstrap over paired steps"}
#: what a results file without ``meta["ratio_statistic"]`` used
LEGACY_RATIO_STATISTIC = "median"
#: how the reports say what a ratio divides
STATISTIC_WORDS = {"geomean": "geometric mean of the paired step ratios over the timed steps",
                   "mean": "mean step over the timed steps (the ratio of throughputs on the same batches)",
                   "median": "median step"}


def ratio_statistic(meta: Dict[str, object]) -> str:
    """The statistic a results file's ``meta`` says its ratios use (the legacy one if unsaid).

    >>> ratio_statistic({"ratio_statistic": "mean"}), ratio_statistic({})
    ('mean', 'median')
    """
    return str(meta.get("ratio_statistic", LEGACY_RATIO_STATISTIC))


def no_worse(interval: Dict[str, float], margin: float = NO_WORSE_MARGIN) -> bool:
    """True when ``interval`` (of other / subject) shows the subject at most ``margin`` slower.

    >>> no_worse({"ratio": 0.99, "low": 0.975, "high": 1.01}), no_worse({"ratio": 1.0, "low": 0.9, "high": 1.1})
    (True, False)
    """
    return interval["low"] >= 1.0 - margin


def faster(interval: Dict[str, float]) -> bool:
    """True when ``interval`` (of other / subject) lies wholly above 1.0: the subject is faster."""
    return interval["low"] > 1.0


def verdict(interval: Dict[str, float]) -> str:
    """The reports' word for a no-slower check: ``"yes, faster"``, ``"yes"`` or ``"NO"``.

    >>> verdict({"low": 1.01}), verdict({"low": 0.98}), verdict({"low": 0.9})
    ('yes, faster', 'yes', 'NO')
    """
    return "yes, faster" if faster(interval) else ("yes" if no_worse(interval) else "NO")


def ratio_of(num: Sequence[float], den: Sequence[float], statistic: str = RATIO_STATISTIC) -> float:
    """``statistic(num) / statistic(den)``; ``statistic`` one of :data:`STATISTICS`.

    >>> ratio_of([2.0, 4.0, 9.0], [1.0, 2.0, 3.0], "mean"), ratio_of([2.0, 4.0, 9.0], [1.0, 2.0, 3.0], "median")
    (2.5, 2.0)
    """
    try:
        f = STATISTICS[statistic]
    except KeyError:
        raise ValueError(f"unknown ratio statistic {statistic!r}; one of {sorted(STATISTICS)}") from None
    return f(num) / f(den)


def interval_method(meta: Dict[str, object]) -> str:
    """How a results file's intervals were computed, in the reports' words."""
    return str(meta.get("interval_method") or INTERVAL_METHODS[ratio_statistic(meta)])


def log_t_interval(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE) -> Dict[str, float]:
    """The geometric mean of the paired ratios ``num[i] / den[i]`` with a Student t interval
    on their logs (``n - 1`` degrees of freedom). With one pair there is no interval: its
    ends are the ratio itself (and no verdict reads a run of fewer than 8 steps).

    >>> r = log_t_interval([2.0, 2.0], [1.0, 1.0])
    >>> r["ratio"], r["low"], r["high"]
    (2.0, 2.0, 2.0)
    >>> r = log_t_interval([1.1, 1.3, 1.2, 1.25], [1.0, 1.0, 1.0, 1.0]); round(r["low"], 3), round(r["high"], 3)
    (1.08, 1.356)
    """
    n = min(len(num), len(den))
    if n == 0:
        raise ValueError("no paired steps to compare")
    logs = [math.log(a / b) for a, b in zip(num[:n], den[:n])]
    mean = statistics.fmean(logs)
    if n < 2:
        return {"ratio": math.exp(mean), "low": math.exp(mean), "high": math.exp(mean), "steps": n}
    from scipy.stats import t  # scipy: installed with fairseq's dependencies

    half = float(t.ppf(0.5 + confidence / 2.0, n - 1)) * statistics.stdev(logs) / math.sqrt(n)
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "steps": n}


def paired_ratio_interval(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE,
                          resamples: int = RESAMPLES, seed: int = 0,
                          statistic: str = RATIO_STATISTIC) -> Dict[str, float]:
    """``statistic(num) / statistic(den)`` with its interval: for ``"geomean"`` (what new
    results use) :func:`log_t_interval`; for the older statistics a percentile bootstrap over
    paired steps, a seeded generator making it reproducible from the results file.

    ``num[i]`` and ``den[i]`` are the step times of two strategies on the same batch.
    Returns ``{"ratio", "low", "high", "steps"}``.

    >>> r = paired_ratio_interval([2.0, 2.2, 1.9, 2.1], [1.0, 1.1, 1.0, 1.0])
    >>> round(r["ratio"], 2), r["low"] <= r["ratio"] <= r["high"]
    (2.0, True)
    """
    if statistic == "geomean":
        return log_t_interval(num, den, confidence)
    n = min(len(num), len(den))
    if n == 0:
        raise ValueError("no paired steps to compare")
    num, den = list(num[:n]), list(den[:n])
    ratio = ratio_of(num, den, statistic)
    rng = random.Random(seed)
    boots = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(ratio_of([num[i] for i in idx], [den[i] for i in idx], statistic))
    boots.sort()
    tail = (1.0 - confidence) / 2.0
    lo = boots[int(tail * (resamples - 1))]
    hi = boots[int(round((1.0 - tail) * (resamples - 1)))]
    return {"ratio": ratio, "low": lo, "high": hi, "steps": n}
