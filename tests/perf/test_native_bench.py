"""The rule that turns native ops on under EMBRACE_NATIVE=auto, and the committed measurement.

``AUTO_NATIVE`` (core.native_ops) is set by hand from the committed benchmark; these
tests recompute, from the committed per-case speedups, what the rule decides, so a
change of the rule, of the summary code or of ``AUTO_NATIVE`` without a new
measurement fails here.
"""
import json
from pathlib import Path

import pytest

from embrace_fairseq.core import native_ops as N
from embrace_fairseq.perf import native_bench as NB

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "native_ops" / "native_ops_bench.json"


def _rows(speedups):
    return [{"op": op, "speedup": s} for op in N.OPS for s in speedups.get(op, [1.0])]


def test_rule_by_hand():
    op = N.OPS[0]
    # geometric mean of 2.0 and 0.8 is 1.265, fast enough, but one case is under 0.95
    assert NB.summarise(_rows({op: [2.0, 0.8]}))[op]["faster"] is False
    got = NB.summarise(_rows({op: [1.21, 1.0]}))[op]  # geomean 1.1 exactly, worst 1.0
    assert got["geomean_speedup"] == pytest.approx(1.1) and got["worst_speedup"] == 1.0
    assert got["best_speedup"] == 1.21
    assert NB.summarise(_rows({op: [1.2, 1.2, 0.96]}))[op]["faster"] is True
    assert NB.summarise(_rows({op: [1.05, 1.1]}))[op]["faster"] is False  # geomean under 1.1


def test_auto_defaults_follow_from_the_committed_cases():
    committed = json.loads(COMMITTED.read_text())
    assert all(case["identical"] for case in committed["cases"])  # only bit-exact ops may be timed
    summary = NB.summarise(committed["cases"])
    # the committed summary is what the rule gives for the committed cases ...
    for op, s in summary.items():
        for k in ("geomean_speedup", "worst_speedup", "best_speedup"):
            assert s[k] == pytest.approx(committed["summary"][op][k], rel=1e-12), (op, k)
    # ... and AUTO_NATIVE is what the rule decides from them (not a copy of the summary's flags)
    assert {op: s["faster"] for op, s in summary.items()} == N.AUTO_NATIVE
    assert committed["rule"] == (f"native by default when geomean speedup >= {NB.MIN_GEOMEAN} "
                                 f"and every case >= {NB.MIN_WORST}")
