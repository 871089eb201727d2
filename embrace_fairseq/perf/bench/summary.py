"""The full benchmark in one page: every EmbRace-over-baseline ratio of several runs.

The full run is several benchmark runs (``scripts/bench_full.sh``: the main models on 4
ranks, the 6+6-layer IWSLT model on 4 ranks with fewer strategies so that their copies fit
in memory, the smaller models on 8 ranks), each with its own ``bench.json``. This page
lists, for each run key (model, ranks, link), EmbRace's step against every stock
baseline's as a speedup (baseline step / EmbRace step, each the statistic its run recorded:
the mean over the timed steps, a ratio of throughputs, or in older runs the median) with
its 95 % paired-bootstrap interval (:mod:`.stats`), for EmbRace at ZeRO-0 (the 2D schedule) and at
ZeRO-1; every strategy's step over the compute-only floor and its bytes over the analytic
minimum; the commit each run measured; and the simulator out of sample over all runs
together (knobs fitted on one model and link, every other run predicted).

``python -m embrace_fairseq.perf.bench.summary results/bench/full/w4 results/bench/full/iwslt_w4 ...
--out results/bench/full/summary``  writes ``summary.md`` and ``summary.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from embrace_fairseq.perf.bench.keys import run_key
from embrace_fairseq.perf.bench.markdown import simulator_section
from embrace_fairseq.perf.bench.merged import merged_bench
from embrace_fairseq.perf.bench.stats import (CONFIDENCE, LEGACY_RATIO_STATISTIC, RATIO_STATISTIC, STATISTIC_WORDS,
                                              paired_ratio_interval, ratio_of, ratio_statistic)
from embrace_fairseq.perf.strategies import FLOOR, get_strategy, is_baseline

#: EmbRace as a user runs it: dense layers at ZeRO-0 under the 2D schedule, or under ZeRO-1
SUBJECTS = ("embrace_schedule", "embrace_zero1")
#: the statistics target: every interval's half-width within this share of its ratio
HALF_WIDTH_GOAL = 0.10


def _key(r: Dict[str, Any]) -> str:
    return run_key(r["model"], r["world_size"], {"gbit": r["link_gbit"], "latency_ms": r["latency_ms"]})


def _statistic(r: Dict[str, Any]) -> str:
    """The statistic a run's ratios use: what its results file recorded (``summarize`` sets
    ``"_statistic"``), else today's."""
    return r.get("_statistic", RATIO_STATISTIC)


def speedups(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per run key, subject and stock baseline: baseline step / subject step with its interval
    (each run's :func:`_statistic` of the timed steps)."""
    by: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(_key(r), {})[r["strategy"]] = r
    out = []
    for key, per in by.items():
        for subject in SUBJECTS:
            if subject not in per:
                continue
            for base, b in per.items():
                if not is_baseline(base):
                    continue
                iv = paired_ratio_interval(b["step_s"], per[subject]["step_s"], statistic=_statistic(b))
                half = max(iv["ratio"] - iv["low"], iv["high"] - iv["ratio"]) / iv["ratio"]
                out.append({"key": key, "model": b["model"], "world_size": b["world_size"],
                            "link_gbit": b["link_gbit"], "subject": subject, "baseline": base,
                            "ratio": iv["ratio"], "low": iv["low"], "high": iv["high"], "steps": iv["steps"],
                            "half_width": half, "statistic": _statistic(b)})
    return out


def _over(runs: List[Dict[str, Any]], refs: Dict[str, Any],
          ratio: Callable[[Dict[str, Any], Any], float]) -> Dict[str, Dict[str, float]]:
    """Per run key: ``ratio(run, that key's reference)`` for each strategy (the floor aside)."""
    out: Dict[str, Dict[str, float]] = {}
    for r in runs:
        ref = refs.get(_key(r))
        if ref is not None and r["strategy"] != FLOOR:
            out.setdefault(_key(r), {})[r["strategy"]] = ratio(r, ref)
    return out


def over_floor(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per run key: each strategy's step over the compute-only floor's (the same statistic
    of the timed steps as the speedups)."""
    floors = {_key(r): r for r in runs if r["strategy"] == FLOOR}
    return _over(runs, floors, lambda r, f: ratio_of(r["step_s"], f["step_s"], _statistic(r)))


def summarize(dirs: Sequence[Path], fit_on: Optional[tuple] = None, sensitivity: bool = True) -> Dict[str, Any]:
    benches = [json.loads((Path(d) / "bench.json").read_text()) for d in dirs]
    parts = []
    for d, b in zip(dirs, benches):
        m = b["meta"]
        parts.append({"dir": str(d), "command": m.get("command"), "source": m.get("source"),
                      "wall_s": m.get("wall_s"), "link": m.get("link"), "schedule": m.get("schedule"),
                      "load_during_run": (m.get("machine") or {}).get("load_during_run"),
                      "ratio_statistic": ratio_statistic(m)})
    # each run read with the statistic its results file recorded
    runs = [dict(r, _statistic=ratio_statistic(b["meta"])) for b in benches for r in b["runs"]]
    sp = speedups(runs)
    try:
        from embrace_fairseq.perf.simulator.validation import out_of_sample

        merged = merged_bench(benches)
        sim = out_of_sample(merged, fit_on=fit_on)
        sim["fit_sensitivity"] = fit_sensitivity(merged) if sensitivity else []
    except Exception as exc:  # the measured figures stand without the simulator
        sim = {"error": f"{type(exc).__name__}: {exc}"}
    return {"parts": parts, "confidence": CONFIDENCE, "statistics": sorted({s["statistic"] for s in sp}),
            "speedups": sp, "over_floor": over_floor(runs),
            "bytes_over_min": _bytes_over_min(runs), "bytes_over_best_min": bytes_over_best(runs),
            "max_half_width": max((s["half_width"] for s in sp), default=None),
            "half_width_goal": HALF_WIDTH_GOAL, "simulator": sim}


def _bytes_over_min(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per run key: each strategy's bytes over its own analytic minimum (what its design must send)."""
    out: Dict[str, Dict[str, float]] = {}
    for r in runs:
        if r.get("bytes_over_min") is not None:
            out.setdefault(_key(r), {})[r["strategy"]] = r["bytes_over_min"]
    return out


def bytes_over_best(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per run key: each strategy's bytes over the lowest analytic minimum of any strategy
    that ran on those batches (the floor aside): how far each is from the best design
    measured, not from its own formula (which its count meets by construction)."""
    best: Dict[str, float] = {}
    for r in runs:
        m = r.get("min_bytes_per_rank_per_step")
        if r["strategy"] != FLOOR and m:
            best[_key(r)] = min(best.get(_key(r), m), m)
    return _over(runs, best, lambda r, b: r["bytes_total_per_rank_per_step"] / b)


def fit_sensitivity(bench: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The simulator's held-out error for every choice of the (model, link) it is fitted on:
    the verdict is the declared default's; this says how much it depends on that choice."""
    from embrace_fairseq.perf.simulator.validation import out_of_sample

    pairs = sorted({(r["model"], float(r["link_gbit"])) for r in bench["runs"]})
    out = []
    for model, gbit in pairs:
        res = out_of_sample(bench, fit_on=(model, gbit))
        if res.get("held_out_mean_abs_rel_error") is not None:
            out.append({"model": model, "link_gbit": gbit, "held_out_mean_abs": res["held_out_mean_abs_rel_error"],
                        "held_out_mean_signed": res["held_out"]["mean_signed_rel_error"]})
    return out


def _commit(source: Optional[Dict[str, Any]]) -> str:
    if not source or not source.get("commit"):
        return "unknown"
    return source["commit"][:10] + (" (dirty)" if source.get("dirty") else "")


def _strategy_table(title: str, per_key: Dict[str, Dict[str, float]]) -> List[str]:
    """A section: one row per run key, one column per strategy."""
    strategies = list(dict.fromkeys(k for per in per_key.values() for k in per))
    if not strategies:
        return []
    L = [f"## {title}", "", "| run | " + " | ".join(get_strategy(x).short for x in strategies) + " |",
         "|---|" + "---|" * len(strategies)]
    L += [f"| {key} | " + " | ".join(f"{per[x]:.2f}" if x in per else "-" for x in strategies) + " |"
          for key, per in per_key.items()]
    return L + [""]


def markdown(s: Dict[str, Any]) -> str:
    L = ["# Full benchmark, all runs", ""]
    stats = s.get("statistics") or [LEGACY_RATIO_STATISTIC]
    L.append("Speedup = baseline step / EmbRace step, each the "
             + " or the ".join(f"{STATISTIC_WORDS[x]} ({x})" for x in stats)
             + (" as its run recorded" if len(stats) > 1 else "") + ", with its "
             f"{100 * s['confidence']:.0f} % paired-bootstrap interval (steps resampled in pairs). "
             "EmbRace at ZeRO-0 is (e), the 2D schedule; (e-z1) is EmbRace with the dense layers "
             "under DeepSpeed ZeRO-1. Each run's own report.md has the details (bytes by kind, "
             "hidden share, timelines, settings of each baseline).")
    L.append("")
    L.append("| run | command | commit | wall | load during the run | ratio of |")
    L.append("|---|---|---|---|---|---|")
    for p in s["parts"]:
        load = p.get("load_during_run")
        L.append(f"| {p['dir']} | `{p['command']}` | {_commit(p['source'])} | "
                 f"{(p['wall_s'] or 0) / 60:.0f} min | "
                 + (f"{load['min']:.1f}-{load['max']:.1f}" if load else "-")
                 + f" | {p.get('ratio_statistic', LEGACY_RATIO_STATISTIC)} |")
    L.append("")
    for subject in SUBJECTS:
        rows = [x for x in s["speedups"] if x["subject"] == subject]
        if not rows:
            continue
        bases = list(dict.fromkeys(x["baseline"] for x in rows))
        L.append(f"## {get_strategy(subject).label} over each baseline")
        L.append("")
        L.append("| model | ranks | link | " + " | ".join(get_strategy(b).short for b in bases) + " |")
        L.append("|---|---|---|" + "---|" * len(bases))
        keys = list(dict.fromkeys((x["model"], x["world_size"], x["link_gbit"]) for x in rows))
        for model, n, gbit in keys:
            cells = []
            for b in bases:
                hit = [x for x in rows if (x["model"], x["world_size"], x["link_gbit"], x["baseline"]) ==
                       (model, n, gbit, b)]
                cells.append(f"{hit[0]['ratio']:.2f}x [{hit[0]['low']:.2f}, {hit[0]['high']:.2f}]" if hit else "-")
            L.append(f"| {model} | {n} | {gbit:g} Gbit/s | " + " | ".join(cells) + " |")
        L.append("")
    if s["max_half_width"] is not None:
        ok = s["max_half_width"] <= s["half_width_goal"]
        L.append(f"Widest interval: +-{100 * s['max_half_width']:.1f} % of its ratio "
                 f"({'within' if ok else 'NOT within'} the +-{100 * s['half_width_goal']:.0f} % target).")
        L.append("")
    L += _strategy_table("Step over the compute-only floor", s["over_floor"])
    L += _strategy_table("Bytes over the lowest analytic minimum of any strategy measured on those batches",
                         s["bytes_over_best_min"])
    L += _strategy_table("Bytes over the strategy's own analytic minimum", s["bytes_over_min"])
    # the run reports' section, over all runs together
    sim = simulator_section({"simulator": s["simulator"]})
    L += [sim[0] + ", all runs together"] + sim[1:] if sim else []
    sens = s["simulator"].get("fit_sensitivity") or []
    if sens:
        L += ["The same, fitted on each (model, link) in turn (the verdict above is the declared default's: "
              "the first model at its lowest link):", "", "| fitted on | held-out mean abs error | mean error |",
              "|---|---|---|"]
        L += [f"| {x['model']} at {x['link_gbit']:g} Gbit/s | {100 * x['held_out_mean_abs']:.1f} % | "
              f"{100 * x['held_out_mean_signed']:+.1f} % |" for x in sens]
        L.append("")
    return "\n".join(L)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench.summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="benchmark result folders (each with bench.json)")
    ap.add_argument("--fit-on", default=None, metavar="MODEL:GBIT", help="the simulator's fitting runs")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    a = ap.parse_args(argv)
    fit_on = None
    if a.fit_on:
        model, gbit = a.fit_on.rsplit(":", 1)
        fit_on = (model, float(gbit))
    s = summarize(a.dirs, fit_on)
    md = markdown(s)
    print(md)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".md").write_text(md)
        a.out.with_suffix(".json").write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
