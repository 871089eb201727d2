"""Run the fault suite and write its report (``docs/RELIABILITY.md``).

    python -m embrace_fairseq.tools.fault_report            # the fast scenarios (what CI runs too)
    python -m embrace_fairseq.tools.fault_report --slow     # every scenario, soak included
    python -m embrace_fairseq.tools.fault_report --slow -k soak   # some of them (pytest arguments pass through)

Runs pytest on ``tests/*/test_reliability_*.py`` with a small plugin that collects, per
test, its outcome and what the test recorded with ``record_property`` (the path it
exercises, the observed outcome, the time to detect the fault). Results are kept in
``docs/reliability.json``; a run without ``--slow`` keeps the earlier results of the
slow scenarios (with their date), so the table always lists every scenario.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DOC = ROOT / "docs" / "RELIABILITY.md"
RESULTS = ROOT / "docs" / "reliability.json"

#: Scenario groups of the report, by test function name.
GROUPS = [
    ("1. Bad input", ("test_bad_ids", "test_empty_batch", "test_ranks_with_different")),
    ("2. A rank dies or is slow", ("test_rank_dies", "test_store_host", "test_rank_killed", "test_slow_rank")),
    ("3. Checkpoints survive", ("test_kill_during", "test_full_disk", "test_truncated", "test_resume_from_corrupted",
                                "test_ds_corrupted", "test_ds_kill_during")),
    ("4. Exact resume", ("test_killed_and_resumed", "test_two_rank_checkpoint", "test_ds_killed_and_resumed",
                         "test_ds_resume")),
    ("5. Numerics agree", ("test_inf", "test_diverged", "test_ds_inf", "test_ds_nan")),
    ("6. Soak", ("test_soak",)),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "7. Other"


class ReportPlugin:
    """Collects one record per test (setup failures and skips included)."""

    def __init__(self) -> None:
        self.records: Dict[str, Dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        rec = self.records.setdefault(report.nodeid, {"nodeid": report.nodeid, "seconds": 0.0, "status": "not run"})
        rec["seconds"] += getattr(report, "duration", 0.0)
        for key, value in getattr(report, "user_properties", []):
            rec[key] = value
        if report.when == "call" and report.passed:
            rec["status"] = "passed"
        if report.skipped:
            rec["status"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            rec.setdefault("outcome", reason.replace("Skipped: ", ""))
        elif report.failed:
            rec["status"] = "failed"
            text = str(report.longrepr)
            rec["outcome"] = "FAILED: " + _last_error_line(text)

    def pytest_collection_modifyitems(self, items: List[Any]) -> None:
        for item in items:
            doc = (getattr(item, "obj", None).__doc__ or "").strip().splitlines()
            scenario = doc[0].rstrip(".") if doc else item.name
            if "[" in item.name:
                scenario += f" [{item.name.split('[', 1)[1].rstrip(']')}]"
            slow = item.get_closest_marker("slow") is not None
            self.records[item.nodeid] = {"nodeid": item.nodeid, "scenario": scenario, "seconds": 0.0,
                                         "status": "not run", "slow": slow, "group": group_of(item.name)}


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")]
    return (lines[0][2:].strip() if lines else text.strip().splitlines()[-1])[:200]


def run_suite(slow: bool, extra: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    import pytest

    plugin = ReportPlugin()
    files = sorted(str(p) for p in TESTS.rglob("test_reliability_*.py"))
    args = ["-q", "-p", "no:cacheprovider", "-m", "" if slow else "not slow", *files, *(extra or [])]
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    pytest.main(args, plugins=[plugin])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = []
    for rec in plugin.records.values():
        if rec["status"] == "not run" or (rec.get("slow") and not slow):
            continue
        rec["when"] = stamp
        out.append(rec)
    return out


def merge(previous: List[Dict[str, Any]], new: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    by_id = {r["nodeid"]: r for r in previous}
    by_id.update({r["nodeid"]: r for r in new})
    return sorted(by_id.values(), key=lambda r: (r.get("group", "9"), r["nodeid"]))


def markdown(records: List[Dict[str, Any]]) -> str:
    passed = sum(r["status"] == "passed" for r in records)
    lines = [
        "# Reliability: the fault suite",
        "",
        "Every scenario below is a test with real ranks (gloo processes, real `fairseq-train`, real",
        "DeepSpeed engines) in `tests/*/test_reliability_*.py`. This file is generated:",
        "",
        "```bash",
        "python -m embrace_fairseq.tools.fault_report          # fast scenarios (also in the default test suite)",
        "python -m embrace_fairseq.tools.fault_report --slow   # all scenarios, soak included (or scripts/fault_suite.sh)",
        "```",
        "",
        f"{passed} of {len(records)} scenarios pass (`docs/reliability.json`). *Detect* is the time from the fault to the last",
        "rank reacting (exit or error), where the test measures it; for bad input found at start-up",
        "or in the first batch it is the whole run until the error, process start included. *s* is",
        "the test's own wall time, on a 2-core CPU machine, at times shared with other jobs",
        f"(Python {platform.python_version()}, {platform.machine()}); *run* is when the scenario last ran.",
        "",
    ]
    current = None
    for r in records:
        if r.get("group") != current:
            current = r.get("group")
            lines += [f"## {current}", "", "| scenario | path | result | outcome | detect | s | run |",
                      "|---|---|---|---|---|---|---|"]
        detect = f"{r['detect_s']:.1f} s" if isinstance(r.get("detect_s"), (int, float)) else ""
        slow = " (slow)" if r.get("slow") else ""
        outcome = str(r.get("outcome", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.get('scenario', r['nodeid'])}{slow} | {r.get('path', '')} | {r['status']} | {outcome} "
                     f"| {detect} | {r['seconds']:.0f} | {r.get('when', '')} |")
        nxt = records.index(r) + 1
        if nxt == len(records) or records[nxt].get("group") != current:
            lines.append("")
    lines += [_MECHANISMS, _LIMITS]
    return "\n".join(lines)


_MECHANISMS = """## What makes these pass

* **Peer watchdog** (`embrace_fairseq/guards/watchdog.py`): each rank writes a heartbeat into the
  rendezvous store every second (or every fifth of the timeout, if shorter) and watches the others.
  A peer whose heartbeat stops for `EMBRACE_PEER_TIMEOUT_S` seconds (default 60; 0 turns it
  off), whose process is gone (same host: seen within one period), which failed while this
  rank still runs, or a store that cannot be reached for the timeout: the rank prints
  `[embrace watchdog] rank K lost: ...` (`ranks K, L lost: rank K: ...; rank L: ...` when
  several are, e.g. the ranks of a node that went away) and exits with status 43. Installed by `run_ranks`,
  by the fairseq plugin when fairseq initialises distributed training, and by the DeepSpeed
  `initialize`. Under torchrun the agent also stops the other workers.
* **Shard-plan agreement** (`embrace_fairseq/core/agreement.py`): building a `ShardedEmbedding`
  all-gathers (rows, dim, padding, world size, `ShardPlan.fingerprint()`) once; ranks that
  disagree all raise `ShardPlanMismatchError` naming the ranks and values.
* **Replica check** (`embrace_fairseq/guards/replica_check.py`): `check_replicas_agree(model)`
  all-gathers a SHA-1 of the dense parameters; the tests call it after every scenario that
  continues training.
* **Atomic checkpoints** (`embrace_fairseq/guards/atomic_io.py`, wired into fairseq by
  `fairseq_adapter/checkpoint_io.py`): write to a temporary file, fsync, `os.replace`,
  fsync the directory; fairseq's copies to `checkpoint_last.pt`/`checkpoint_best.pt` go the
  same way (stock fairseq copies in place). Each file gets a `.sha256` sidecar, so a flipped
  bit inside a tensor is refused (`CorruptCheckpointError`) instead of loaded; a failed write
  raises `CheckpointWriteError` naming the file and the cause and leaves the old file.
* **Bad ids**: the sharded lookup's header carries an error flag, so an id outside the table
  on any rank raises `InvalidIdError` on every rank (core); fairseq-train stops with it when
  the dictionary does not match the binarised data.
"""

_LIMITS = """## Limits

* Nothing here ran on a GPU: NCCL collectives may block where gloo errors; the watchdog then
  is what stops the ranks. fp16 loss scaling (skip the step and lower the scale on overflow)
  is not exercised on CPU; on CPU a non-finite gradient norm stops fairseq-train on every rank.
* The watchdog ends a rank with `os._exit`: no Python cleanup runs in that process.
  Detection of a killed process within one period needs the ranks on one host; across hosts
  it takes the timeout.
* A stall longer than `EMBRACE_PEER_TIMEOUT_S` in which a rank's Python threads cannot run
  (e.g. a single C call holding the GIL that long) would be taken for a hang.
* Checkpoint files written by other tools have no sidecar: those are only checked for
  truncation (torch's reader), not for flipped bits. Copying another file over a checkpoint by
  hand leaves its old `.sha256` behind, and loading then refuses it: delete the sidecar too.
* The watchdog does not replace the collective timeouts: a rank that is alive and beating
  but never reaches a collective (a bug, not a fault) still waits for gloo's timeout.
"""


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.tools.fault_report", description=__doc__.splitlines()[0])
    ap.add_argument("--slow", action="store_true", help="run every scenario, soak included")
    ap.add_argument("--out", default=str(DOC), help="Markdown report (default docs/RELIABILITY.md)")
    ap.add_argument("--results", default=str(RESULTS), help="JSON results kept between runs")
    ap.add_argument("--report-only", action="store_true", help="rewrite the Markdown from the kept results")
    a, pytest_args = ap.parse_known_args(argv)  # the rest goes to pytest (e.g. -k kill)
    a.pytest_args = pytest_args
    new = [] if a.report_only else run_suite(a.slow, a.pytest_args)
    # read the kept results only now: another run may have written them meanwhile
    previous = json.loads(Path(a.results).read_text()) if Path(a.results).exists() else []
    records = merge(previous, new)
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps(records, indent=1) + "\n")
    Path(a.out).write_text(markdown(records))
    print(f"wrote {a.out} ({len(new)} scenarios run, {len(records)} listed)")
    return 0 if all(r["status"] in ("passed", "skipped") for r in new) else 1


if __name__ == "__main__":
    sys.exit(main())
