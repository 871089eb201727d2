"""Intervals for ratios of step times measured side by side.

The strategies of a benchmark run step through the same batches (step ``i`` of every
strategy trains on batch ``i``), interleaved in rounds, so their step times are paired
by step: a bootstrap that resamples *step indices* keeps the pairing and with it the
batch-to-batch variation that both strategies share.

The statistic is the ratio of the *mean* step times over those steps: the ratio of the
time each strategy took for the same batches, i.e. of their throughputs (what fairseq's
``wps`` shows a user). A results file names the statistic its intervals were computed
with (``meta["ratio_statistic"]``); files written before it was recorded used the ratio of
the medians, and are read that way (:data:`LEGACY_RATIO_STATISTIC`). The mean is a smooth
statistic whose bootstrap is well behaved with a dozen steps; the median's bootstrap
distribution takes only a few values at that size, which made its intervals wide and
ragged.
"""
from __future__ import annotations

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
STATISTICS: Dict[str, Callable[[Sequence[float]], float]] = {"mean": statistics.fmean,
                                                              "median": statistics.median}
#: what new results use: the ratio of total times over the same batches (throughputs)
RATIO_STATISTIC = "mean"
#: what a results file without ``meta["ratio_statistic"]`` used
LEGACY_RATIO_STATISTIC = "median"
#: how the reports say what a ratio divides
STATISTIC_WORDS = {"mean": "mean step over the timed steps (the ratio of throughputs on the same batches)",
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

    >>> ratio_of([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]), ratio_of([2.0, 4.0, 9.0], [1.0, 2.0, 3.0], "median")
    (2.5, 2.0)
    """
    try:
        f = STATISTICS[statistic]
    except KeyError:
        raise ValueError(f"unknown ratio statistic {statistic!r}; one of {sorted(STATISTICS)}") from None
    return f(num) / f(den)


def paired_ratio_interval(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE,
                          resamples: int = RESAMPLES, seed: int = 0,
                          statistic: str = RATIO_STATISTIC) -> Dict[str, float]:
    """``statistic(num) / statistic(den)`` with a percentile-bootstrap interval over paired steps.

    ``num[i]`` and ``den[i]`` are the step times of two strategies on the same batch.
    Returns ``{"ratio", "low", "high", "steps"}``; a seeded generator makes the interval
    reproducible from the results file.

    >>> r = paired_ratio_interval([2.0, 2.2, 1.9, 2.1], [1.0, 1.1, 1.0, 1.0])
    >>> round(r["ratio"], 2), r["low"] <= r["ratio"] <= r["high"]
    (2.0, True)
    """
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
