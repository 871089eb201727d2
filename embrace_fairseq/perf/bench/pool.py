"""One verdict from several independent benchmark runs of the same comparison.

A run's paired-bootstrap interval (:mod:`.stats`) covers the step-to-step noise *within*
that run. On a shared machine one run's conditions (load, memory placement, which
strategy's buffers landed where) also shift a ratio as a whole, and that shift differs
from run to run: two runs of the same code can give intervals that do not overlap. A goal
judged on one run then passes or fails by chance.

This module combines runs as a random-effects meta-analysis does: each run's ratio is one
estimate (log scale, variance from its own interval); the between-run variance ``tau^2``
is estimated from their spread (DerSimonian-Laird), each run is weighted by
``1 / (v_i + tau^2)``, and the interval uses the Hartung-Knapp-Sidik-Jonkman variance
(never narrower than the fixed-weights one) with Student's t on ``k - 1`` degrees of
freedom: with few runs the interval is honest about how little they pin down.

``python -m embrace_fairseq.perf.bench.pool results/bench/layouts_a results/bench/layouts_b ...``
prints, per run key, every run's contiguous/strided ratio and the pooled one with its
verdict, and writes them with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
from statistics import NormalDist
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from embrace_fairseq.perf.bench.stats import CONFIDENCE, NO_WORSE_MARGIN, faster, no_worse, verdict

# Student's t, two-sided 95 %: t_{0.975, df} for df = 1..30; beyond, the normal 1.96 is
# within 2 % of it.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = NormalDist().inv_cdf(0.975)


def _t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else _Z975


def pooled_ratio(estimates: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Random-effects pooled ratio of several runs' ``{"ratio", "low", "high"}`` (95 % intervals).

    Returns ``{"ratio", "low", "high", "runs", "tau"}`` where ``tau`` is the between-run
    standard deviation of the log ratio.

    >>> r = pooled_ratio([{"ratio": 1.00, "low": 0.98, "high": 1.02},
    ...                   {"ratio": 0.96, "low": 0.94, "high": 0.98}])
    >>> round(r["ratio"], 3), r["low"] < 0.96 < 1.00 < r["high"]
    (0.98, True)
    """
    if not estimates:
        raise ValueError("no runs to pool")
    y = [math.log(e["ratio"]) for e in estimates]
    # the run's own interval gives its standard error on the log scale
    v = [max(((math.log(e["high"]) - math.log(e["low"])) / (2 * _Z975)) ** 2, 1e-12) for e in estimates]
    k = len(y)
    if k == 1:
        return {"ratio": estimates[0]["ratio"], "low": estimates[0]["low"], "high": estimates[0]["high"],
                "runs": 1, "tau": float("nan")}
    w = [1.0 / vi for vi in v]
    sw = sum(w)
    y_fixed = sum(wi * yi for wi, yi in zip(w, y)) / sw
    q = sum(wi * (yi - y_fixed) ** 2 for wi, yi in zip(w, y))
    tau2 = max(0.0, (q - (k - 1)) / (sw - sum(wi * wi for wi in w) / sw))
    ws = [1.0 / (vi + tau2) for vi in v]
    sws = sum(ws)
    mu = sum(wi * yi for wi, yi in zip(ws, y)) / sws
    # Hartung-Knapp scale, floored at 1 so that agreeing runs do not shrink the interval
    # below what their own variances allow
    hk = max(1.0, sum(wi * (yi - mu) ** 2 for wi, yi in zip(ws, y)) / (k - 1))
    half = _t975(k - 1) * math.sqrt(hk / sws)
    return {"ratio": math.exp(mu), "low": math.exp(mu - half), "high": math.exp(mu + half),
            "runs": k, "tau": math.sqrt(tau2)}


def pool_layout_checks(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per run key present in any run's ``layouts``: every run's contiguous/strided interval
    (with the commit it was measured on) and the pooled one, with the verdicts the benchmark
    uses (no slower: :func:`.stats.no_worse` of the pooled interval; faster: its lower end
    above 1.0)."""
    per_key: Dict[str, List[Dict[str, Any]]] = {}
    for res in results:
        commit = ((res.get("meta") or {}).get("source") or {}).get("commit")
        for key, check in (res.get("layouts") or {}).items():
            per_key.setdefault(key, []).append(dict(check["contiguous_over_strided"], commit=commit))
    out: Dict[str, Any] = {}
    for key, runs in per_key.items():
        pooled = pooled_ratio(runs)
        out[key] = {"runs": runs, "pooled": pooled, "no_worse": no_worse(pooled), "better": faster(pooled)}
    return out


def markdown(pooled: Dict[str, Any], sources: Sequence[str]) -> str:
    L = ["# Shard layouts over independent runs: contiguous / strided step time", "",
         "Runs pooled: " + ", ".join(f"`{s}`" for s in sources) + ".", "",
         "Each run: ratio of median steps with its paired-bootstrap 95 % interval. Pooled: random-effects "
         "(DerSimonian-Laird between-run variance, Hartung-Knapp interval on k - 1 degrees of freedom). "
         f"Strided no slower when the pooled interval's lower end is at least {1 - NO_WORSE_MARGIN:.2f} "
         f"(at most {100 * NO_WORSE_MARGIN:.0f} % slower); faster when it lies above 1.0.", "",
         "| run key | runs (ratio [95 %]) | between-run sd | pooled | strided no slower |", "|---|---|---|---|---|"]
    for key, c in pooled.items():
        runs = "; ".join(f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" for r in c["runs"])
        p = c["pooled"]
        tau = "-" if math.isnan(p["tau"]) else f"{p['tau']:.3f}"
        L.append(f"| {key} | {runs} | {tau} | {p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}] | {verdict(p)} |")
    commits = sorted({str(r.get("commit"))[:12] for c in pooled.values() for r in c["runs"]})
    L += ["", "Commits measured: " + ", ".join(f"`{c}`" for c in commits) + "."]
    return "\n".join(L) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench.pool",
                                description="Pool the shard-layout comparison of several benchmark runs.")
    p.add_argument("runs", nargs="+", type=Path, help="benchmark output folders (each with bench.json)")
    p.add_argument("--out", type=Path, help="write the report (.md) and its data (.json beside it)")
    a = p.parse_args(argv)
    results = []
    for d in a.runs:
        f = d / "bench.json" if d.is_dir() else d
        results.append(json.loads(f.read_text()))
    pooled = pool_layout_checks(results)
    if not pooled:
        raise SystemExit("none of these runs compared the layouts (strategies embrace_schedule,embrace_contiguous)")
    text = markdown(pooled, [str(d) for d in a.runs])
    print(text, end="")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps({"sources": [str(d) for d in a.runs], "confidence": CONFIDENCE,
                                                          "layouts": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
