"""Intervals for ratios of step times measured side by side.

The strategies of a benchmark run step through the same batches (step ``i`` of every
strategy trains on batch ``i``), interleaved in rounds, so their step times are paired
by step: a bootstrap that resamples *step indices* keeps the pairing and with it the
batch-to-batch variation that both strategies share. The statistic is the ratio of the
medians, the figure the report prints.
"""
from __future__ import annotations

import random
import statistics
from typing import Dict, Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000
# "No slower" is a non-inferiority claim: the interval's lower end must show the ratio is
# at most this far below 1.0. (Asking only that the upper end reach 1.0 would let a noisier
# measurement pass more easily.)
NO_WORSE_MARGIN = 0.03


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


def ratio_of_medians(num: Sequence[float], den: Sequence[float]) -> float:
    return statistics.median(num) / statistics.median(den)


def paired_ratio_interval(num: Sequence[float], den: Sequence[float], confidence: float = CONFIDENCE,
                          resamples: int = RESAMPLES, seed: int = 0) -> Dict[str, float]:
    """``median(num) / median(den)`` with a percentile-bootstrap interval over paired steps.

    ``num[i]`` and ``den[i]`` are the step times of two strategies on the same batch.
    Returns ``{"ratio", "low", "high", "steps"}``; a seeded generator makes the interval
    reproducible from the results file.

    >>> r = paired_ratio_interval([2.0, 2.2, 1.9, 2.1], [1.0, 1.1, 1.0, 1.0])
    >>> round(r["ratio"], 2), r["low"] <= r["ratio"] <= r["high"]
    (2.05, True)
    """
    n = min(len(num), len(den))
    if n == 0:
        raise ValueError("no paired steps to compare")
    num, den = list(num[:n]), list(den[:n])
    rng = random.Random(seed)
    boots = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        boots.append(ratio_of_medians([num[i] for i in idx], [den[i] for i in idx]))
    boots.sort()
    tail = (1.0 - confidence) / 2.0
    lo = boots[int(tail * (resamples - 1))]
    hi = boots[int(round((1.0 - tail) * (resamples - 1)))]
    return {"ratio": ratio_of_medians(num, den), "low": lo, "high": hi, "steps": n}
