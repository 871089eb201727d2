"""The regime benchmark's goals, judged on a results file (``--regime`` runs).

Every ratio is judged on its 95 % interval's lower end, written as a speed-up (above 1:
EmbRace's (e) is faster), so that one rule reads every goal:

* (e) over every stock baseline of the run: the workload's target per regime
  (:data:`SPEEDUP_TARGETS`; the translation model and the GPT-2-shaped LM "never slower
  than the fastest baseline" is the non-inferiority margin of :mod:`.stats`: lower end at
  least 0.97); a synthetic workload (:data:`.shapes.SYNTHETIC`) carries no goal;
* every verdict needs :data:`MIN_STEPS` timed steps per strategy ("too few steps" else),
  and every verdict of a run whose calibration drifted (:func:`calibration_drift`) says so;
* the limit over (e)'s step (the limit: the compute-only floor or the least bytes over the
  link, :func:`.report.regime_check`) at least 1 / :data:`LIMIT_FACTOR`, i.e. (e) within
  1.15x of the limit;
* where the run holds the schedule's ablation: FIFO overlap over (e) at least
  :data:`SCHEDULE_OVER_FIFO` (the goal names ``a100-100g`` on 2 ranks; every regime and
  world size of the run is judged and labelled, so a reader sees which one the goal means);
* the simulator, fitted on one workload and regime, within :data:`SIMULATOR_TARGET` mean
  absolute error on every other workload.

The goals are stated for 4 ranks unless said; each verdict carries the run's world size.
``python -m embrace_fairseq.perf.bench.regime_goals DIR... [--out FILE.md]`` writes the
verdicts of several results folders as one table.

>>> goal_verdict(2.6, 2.4, 2.5)
'MISSED'
>>> goal_verdict(2.6, 2.55, 2.5)
'met'
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from embrace_fairseq.perf.bench.shapes import is_synthetic
from embrace_fairseq.perf.bench.stats import NO_WORSE_MARGIN, paired_ratio_interval
from embrace_fairseq.perf.strategies import FLOOR, SPEEDUP_SUBJECT, get_strategy, is_baseline

FIFO = "embrace_fifo"
#: the default plan, judged against every other strategy of its run
AUTO = "embrace_auto"
#: the default plan at least this fast as the fastest other strategy (lower end)
AUTO_TARGET = 1.0 - NO_WORSE_MARGIN
#: the plan's predicted step within this share of the measured one
PREDICTION_TARGET = 0.15
#: (e) over every stock baseline, per workload and regime (None: every regime)
#: a synthetic workload (:data:`.shapes.SYNTHETIC`) carries no goal
SPEEDUP_TARGETS: Dict[str, Dict[Optional[str], float]] = {
    "xlmr": {None: 1.4},
    "mbart": {None: 1.15},
    "m2m": {None: 1.15},
    # the translation model and the GPT-2-shaped LM: never slower than the fastest baseline
    "translation": {None: 1.0 - NO_WORSE_MARGIN},
    "gpt_lm": {None: 1.0 - NO_WORSE_MARGIN},
}
#: timed steps per strategy a verdict needs (fewer: "too few steps", whatever the interval)
MIN_STEPS = 8
LIMIT_FACTOR = 1.15
SCHEDULE_OVER_FIFO = 1.15
SIMULATOR_TARGET = 0.15
#: the timed floor over the floor the link was calibrated on, within which a run is in its regime
CALIBRATION_BAND = (0.8, 1.25)
#: what every number of a run whose calibration drifted carries
DRIFT_FLAG = "calibration drifted"


def goal_verdict(ratio: float, low: float, target: float, steps: Optional[int] = None) -> str:
    """``met`` when the interval's lower end reaches the target; with ``steps`` below
    :data:`MIN_STEPS`, no verdict.

    >>> goal_verdict(2.0, 1.5, 1.4, steps=3)
    'too few steps (3 < 8)'
    """
    if steps is not None and steps < MIN_STEPS:
        return f"too few steps ({steps} < {MIN_STEPS})"
    return "met" if low >= target else "MISSED"


def _target(model: str, regime: Optional[str]) -> Optional[float]:
    per = SPEEDUP_TARGETS.get(model, {})
    return per.get(regime, per.get(None))


def _row(run: str, goal: str, target: float, iv: Dict[str, float], world: int) -> Dict[str, Any]:
    return {"run": run, "goal": goal, "target": target, "ratio": iv["ratio"], "low": iv["low"], "high": iv["high"],
            "steps": iv.get("steps"), "world_size": world,
            "verdict": goal_verdict(iv["ratio"], iv["low"], target, iv.get("steps"))}


def regime_goal_check(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per goal and run key of a regime results file (empty without regimes)."""
    rows: List[Dict[str, Any]] = []
    runs = {(r["model"], r["world_size"], r.get("regime")) for r in result.get("runs", []) if r.get("regime")}
    intervals = result.get("ratio_intervals", {})
    for model, world, regime in sorted(runs):
        key = f"{model}/w{world}/{regime}"
        calibration = (result.get("regimes") or {}).get(key) or {}
        drift = calibration_drift(key, calibration, world)
        if is_synthetic(model):  # no goal; only whether its calibration held
            rows += [drift] if drift is not None else []
            continue
        first = len(rows)
        per = intervals.get(key, {})
        target = _target(model, regime)
        if target is not None:
            for s, iv in per.items():
                if not is_baseline(s):
                    continue
                rows.append(_row(key, f"(e) over {s}", target, iv, world))
        rows += auto_rows(result, model, world, regime)
        if FIFO in per:
            rows.append(_row(key, f"(e) over {FIFO}", SCHEDULE_OVER_FIFO, per[FIFO], world))
        limit = calibration.get("limit") or {}
        over = (limit.get("over_limit") or {}).get(SPEEDUP_SUBJECT)
        if over:  # step / limit -> limit / step: a speed-up read like the others
            inv = {"ratio": 1.0 / over["ratio"], "low": 1.0 / over["high"], "high": 1.0 / over["low"],
                   "steps": over.get("steps")}
            rows.append(_row(key, "limit over (e)", 1.0 / LIMIT_FACTOR, inv, world))
        if drift is not None:
            if drift["drifted"]:  # every verdict of the run carries the flag, not only the drift row
                for r in rows[first:]:
                    r["verdict"] += f" ({DRIFT_FLAG})"
            rows.append(drift)
    return rows + simulator_rows(result.get("simulator") or {})


def auto_rows(result: Dict[str, Any], model: str, world: int, regime: Optional[str]) -> List[Dict[str, Any]]:
    """The default plan's goals in one run key: at least :data:`AUTO_TARGET` of the fastest
    other strategy (every baseline and every fixed EmbRace configuration of the run; paired
    steps, lower end of the interval), and its predicted step within
    :data:`PREDICTION_TARGET` of the measured one (the mean of the timed steps)."""
    runs = {r["strategy"]: r for r in result.get("runs", [])
            if r["model"] == model and r["world_size"] == world and r.get("regime") == regime}
    auto = runs.get(AUTO)
    if auto is None:
        return []
    key = f"{model}/w{world}/{regime}"
    others = {s: paired_ratio_interval(r["step_s"], auto["step_s"]) for s, r in runs.items() if s not in (AUTO, FLOOR)}
    rows = []
    plan = (auto.get("settings") or {}).get("plan") or {}
    what = f"plan {plan.get('spec', '?')}, schedule {'on' if plan.get('schedule') else 'off'}"
    if others:
        fastest = min(others, key=lambda s: others[s]["ratio"])
        rows.append(_row(key, f"auto ({what}) over the fastest other, {fastest}", AUTO_TARGET, others[fastest], world))
    if plan.get("predicted_step_s"):
        measured = sum(auto["step_s"]) / len(auto["step_s"])
        err = plan["predicted_step_s"] / measured - 1.0
        rows.append({"run": key, "goal": "auto's predicted step against the measured", "target": None,
                     "target_text": f"within {100 * PREDICTION_TARGET:.0f} %",
                     "measured": f"{plan['predicted_step_s']:.3f} s / {measured:.3f} s ({100 * err:+.0f} %)",
                     "ratio": err, "low": None, "high": None, "steps": len(auto["step_s"]), "world_size": world,
                     "verdict": "met" if abs(err) <= PREDICTION_TARGET else "MISSED"})
    return rows


def calibration_drift(key: str, calibration: Dict[str, Any], world: int) -> Optional[Dict[str, Any]]:
    """Whether the floor the link was calibrated on held through the timed steps: the timed
    floor's mean (the limit's ``floor_s``, :func:`.report.regime_check`) over the
    calibration's floor within :data:`CALIBRATION_BAND`. Where it did not, the run's
    communication took another share of the step than the regime's, and its verdicts do not
    speak for that regime."""
    limit = calibration.get("limit") or {}
    if not calibration.get("floor_s") or not limit.get("floor_s"):
        return None
    timed, calibrated = limit["floor_s"], calibration["floor_s"]
    ratio = timed / calibrated
    lo, hi = CALIBRATION_BAND
    held = lo <= ratio <= hi
    return {"run": key, "goal": "calibration held (timed floor / calibrated floor)", "target": None,
            "measured": f"{ratio:.2f}x ({timed:.3f} s / {calibrated:.3f} s)",
            "target_text": f"{lo:.2f}-{hi:.2f}x", "ratio": ratio, "low": None, "high": None,
            "steps": len(limit.get("limit_steps_s") or []), "world_size": world, "drifted": not held,
            "verdict": "held" if held else "DRIFTED: not this regime"}


def drift_flag(calibration: Dict[str, Any]) -> str:
    """The flag a drifted run's numbers carry wherever they are shown ("" where it held or
    nothing says)."""
    drift = calibration_drift("", calibration, 0)
    return f" ({DRIFT_FLAG} {drift['ratio']:.2f}x)" if drift is not None and drift["drifted"] else ""


def simulator_rows(sim: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per workload of an out-of-sample validation
    (:func:`embrace_fairseq.perf.simulator.validation.out_of_sample`): its mean absolute
    error against :data:`SIMULATOR_TARGET`."""
    rows = []
    fitted = sim.get("fitted_on", {})
    for model, s in (sim.get("by_model") or {}).items():
        mae = s["mean_abs_rel_error"]
        rows.append({"run": f"{model} (simulator, fitted on {fitted.get('model')}/{fitted.get('regime')})",
                     "goal": "simulator mean abs error", "target": SIMULATOR_TARGET, "ratio": mae, "low": None,
                     "high": None, "steps": s.get("count"), "world_size": None,
                     "verdict": "met" if mae <= SIMULATOR_TARGET else "MISSED"})
    return rows


def simulator_across(dirs: List[Path], fit_on: Tuple[str, str]) -> Dict[str, Any]:
    """The simulator fitted on one workload and regime (``fit_on``: (model, regime)) of
    several results folders together, every other workload of every folder predicted out of
    sample: one fit for all, where each folder's own file fits on its own first run."""
    from embrace_fairseq.perf.bench.merged import merged_bench
    from embrace_fairseq.perf.simulator.validation import out_of_sample

    merged = merged_bench([json.loads((d / "bench.json").read_text()) for d in dirs])
    return out_of_sample(merged, fit_on=fit_on)


def goals_markdown(rows: List[Dict[str, Any]], source: str = "") -> List[str]:
    """A table of the verdicts (speed-ups as ``ratio [low, high]``, judged on ``low``)."""
    if not rows:
        return []
    L = ["## Goals in the regimes" + (f" ({source})" if source else ""), "",
         "Each speed-up is (other step) / ((e)'s step), judged on its 95 % interval's lower end; \"limit over (e)\" "
         f"at least {1 / LIMIT_FACTOR:.3f} is (e) within {LIMIT_FACTOR}x of the limit. Goals are stated for 4 ranks "
         "unless said; the ranks column says what was measured.", "",
         "| run | ranks | goal | target | measured | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "measured" in r:
            measured, target = r["measured"], r["target_text"]
        elif r["low"] is None:
            measured = f"{100 * r['ratio']:.1f} % ({r['steps']} runs)"
            target = f"{100 * r['target']:.0f} %"
        else:
            measured = f"{r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}] ({r['steps']} steps)"
            target = f"{r['target']:.2f}x"
        L.append(f"| {r['run']} | {r['world_size'] or '-'} | {r['goal']} | {target} | {measured} | {r['verdict']} |")
    return L + [""]


TABLE_BEGIN_PREFIX = "<!-- regime-table:begin"
TABLE_END = "<!-- regime-table:end -->"
#: the simulator's 16-64 GPU projection the table shows beside each measured run
PROJECTION = Path("results/simulator/regime_projection.json")


def _table_begin(page: Path) -> str:
    return f"{TABLE_BEGIN_PREFIX} (python -m embrace_fairseq.perf.bench.regime_goals --write {page} DIR...) -->"


def projected_cell(projection: Optional[Dict[str, Any]], real_model: str, regime: str) -> str:
    """The projection of ``real_model`` in ``regime`` at 16-64 GPUs, one NIC per GPU: (e)
    over c10d and the default plan over c10d, each as its range over the GPU counts."""
    rows = [r for r in ((projection or {}).get("models", {}).get(real_model, {}).get("results") or [])
            if r.get("regime") == regime and r.get("topology") == "flat"]
    if not rows:
        return "-"

    def span(values: List[float]) -> str:
        lo, hi = min(values), max(values)
        return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"

    e = [r["step_s"]["fairseq_c10d"] / r["step_s"][SPEEDUP_SUBJECT] for r in rows]
    auto = [r["step_s"]["fairseq_c10d"] / r["step_s"][AUTO] for r in rows if AUTO in r["step_s"]]
    return f"{span(e)} / {span(auto) if auto else '-'}"


def performance_rows(folder: str, result: Dict[str, Any], projection: Optional[Dict[str, Any]] = None) -> List[str]:
    """Per run key of a regime results file: the real model, (e) over the fastest stock
    baseline of the run and over c10d, the default plan over the fastest baseline, and
    (e)'s step over the limit, each with its 95 % interval; the simulator's projection of
    the real model at 16-64 GPUs (:func:`projected_cell`), and the commit (the page cites
    ``folder`` above the table)."""
    rows = []
    src = result.get("meta", {}).get("source") or {}
    # a tree with uncommitted changes (other files than the bench's) is marked, not hidden
    commit = src.get("commit", "?")[:7] + ("*" if src.get("dirty") else "")
    for key, per in sorted((result.get("ratio_intervals") or {}).items()):
        cal = (result.get("regimes") or {}).get(key) or {}
        if not cal.get("regime"):
            continue
        base = {s: iv for s, iv in per.items() if is_baseline(s)}
        if not base:
            continue
        fastest = min(base, key=lambda s: base[s]["ratio"])
        over = ((cal.get("limit") or {}).get("over_limit") or {}).get(SPEEDUP_SUBJECT)

        def cell(iv: Optional[Dict[str, float]]) -> str:
            return "-" if not iv else f"{iv['ratio']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}]"

        model = key.split("/")[0]
        name = f"{key} (synthetic)" if is_synthetic(model) else key
        rows.append(f"| {name}{drift_flag(cal)} | {cal.get('real_model', '-')} | {cell(base[fastest])} ({fastest}) | "
                    f"{cell(base.get('fairseq_c10d'))} | {_auto_cell(result, key, fastest, cell)} | {cell(over)} | "
                    f"{projected_cell(projection, cal.get('real_model', ''), cal['regime'])} | {commit} |")
    return rows


def _auto_cell(result: Dict[str, Any], key: str, fastest: str, cell: Callable[[Optional[Dict[str, float]]], str]) -> str:
    """The default plan over the fastest baseline, and what it planned ("-": not run)."""
    runs = {r["strategy"]: r for r in result.get("runs", [])
            if f"{r['model']}/w{r['world_size']}/{r.get('regime')}" == key}
    auto, base = runs.get(AUTO), runs.get(fastest)
    if auto is None or base is None:
        return "-"
    plan = (auto.get("settings") or {}).get("plan") or {}
    planned = "row-shard" in plan.get("spec", "") or "vocab-parallel" in plan.get("spec", "")
    return f"{cell(paired_ratio_interval(base['step_s'], auto['step_s']))} ({'sharded' if planned else 'stock'})"


def performance_table(folders: List[Path], page: Path, projection: Optional[Path] = PROJECTION) -> List[str]:
    proj = json.loads(projection.read_text()) if projection is not None and projection.exists() else None
    L = [_table_begin(page),
         "| workload/ranks/regime | real model | (e) over the fastest baseline | (e) over c10d | default plan over "
         "the fastest baseline | (e) step / limit | projected, 16-64 GPUs: (e) / default plan over c10d | commit |",
         "|---|---|---|---|---|---|---|---|"]
    for d in folders:
        L += performance_rows(str(d), json.loads((d / "bench.json").read_text()), proj)
    return L + [TABLE_END]


def _write_table(page: Path, table: List[str]) -> None:
    text = page.read_text()
    a = text.index(TABLE_BEGIN_PREFIX)
    b = text.index(TABLE_END, a) + len(TABLE_END)
    page.write_text(text[:a] + "\n".join(table) + text[b:])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench.regime_goals",
                                 description="The regime goals of several results folders, as one table.")
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write the goals here (markdown)")
    ap.add_argument("--write", type=Path, default=None,
                    help="replace the performance table between the regime-table markers of this page")
    ap.add_argument("--fit-on", default=None, metavar="MODEL:REGIME",
                    help="add the simulator fitted on this workload and regime of all the folders together, "
                         "every other workload predicted out of sample")
    a = ap.parse_args(argv)
    if a.write:
        _write_table(a.write, performance_table(a.dirs, a.write))
        print(f"wrote the performance table of {len(a.dirs)} folder(s) into {a.write}")
        return 0
    L = ["# Goals of the regime benchmark", ""]
    for d in a.dirs:
        result = json.loads((d / "bench.json").read_text())
        src = result.get("meta", {}).get("source", {})
        L += goals_markdown(regime_goal_check(result), f"`{d}`, commit {src.get('commit', '?')[:7]}")
    if a.fit_on:
        model, _, regime = a.fit_on.partition(":")
        if not regime:
            ap.error(f"--fit-on wants MODEL:REGIME, got {a.fit_on!r}")
        sim = simulator_across(a.dirs, (model, regime))
        L += ["## The simulator across the folders", "",
              f"Knobs fitted on {model}/{regime} of {', '.join(f'`{d}`' for d in a.dirs)} together "
              f"({sim['fitted_on']['runs']} runs): "
              + ", ".join(f"{k} {v:g}" for k, v in sim["knobs"].items())
              + ". Every other run of every folder predicted out of sample.", ""]
        L += goals_markdown(simulator_rows(sim))[4:]
    text = "\n".join(L)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
