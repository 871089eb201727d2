"""The model against measured runs: prediction errors (:func:`validate`) and a fit of
the network knobs with held-out errors (:func:`fit_network`), from a bench JSON."""
from __future__ import annotations

import itertools
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from embrace_fairseq.perf.simulator.network import Network
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, canonical_strategy

FIT_GRID = {
    "efficiency": (0.5, 0.75, 1.0),
    "overhead_s": (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3),
    "host_s_per_byte": (0.0, 1e-9, 2e-9, 4e-9, 6e-9, 8e-9, 12e-9, 16e-9),
}


def runs_and_profiles(bench: dict) -> Tuple[Dict[str, Profile], List[dict]]:
    """The bench JSON's profiles (parsed) and runs."""
    if "profiles" not in bench or "runs" not in bench:
        raise ValueError("bench JSON needs 'profiles' and 'runs' objects")
    profiles = {name: Profile.from_json(name, d) for name, d in bench["profiles"].items()}
    runs = list(bench["runs"])
    for name, prof in profiles.items():
        # a profile that does not say: runs that all-gathered the table had a tied output
        if "tied_output" not in bench["profiles"][name] and any(
            r.get("model") == name and (r.get("bytes_per_rank_per_step") or {}).get("table_gather", 0) > 0 for r in runs
        ):
            prof.tied_output = "gather"
    return profiles, runs


def validate(bench: dict, *, latency_floor_s: float = 0.0, efficiency: float = 1.0, overhead_s: float = 0.0,
             host_s_per_byte: float = 0.0, tied: Optional[Dict[str, str]] = None,
             opts: Options = Options(defer_rows=False), oversubscription: bool = True) -> dict:
    """Predict every measured run of a bench JSON; relative errors per run and summary.

    By default the schedule is modelled as implemented (no deferral of gradient rows
    into the next forward: the exchange is synchronous in ``ShardedEmbedding``).
    With ``oversubscription`` the compute (measured one process at a time) is scaled
    by ``max(1, N / cpus)`` when N ranks share the machine's ``cpus`` cores.
    """
    profiles, runs = runs_and_profiles(bench)
    knobs = {"efficiency": efficiency, "overhead_s": overhead_s, "host_s_per_byte": host_s_per_byte,
             "latency_floor_s": latency_floor_s}
    return validate_parsed(profiles, runs, bench.get("meta", {}), knobs, tied, opts, oversubscription)


def _predict_run(run: dict, profiles: Dict[str, Profile], knobs: Dict[str, float], opts: Options,
                 latency_applied: bool, cpus: int, oversubscription: bool) -> Optional[Dict[str, Any]]:
    """One measured run against its prediction; None when it cannot be predicted."""
    if run.get("median_step_s") is None or run.get("model") not in profiles:
        return None
    try:
        strategy = canonical_strategy(str(run["strategy"]))
    except ValueError:
        return None  # unknown strategy names are skipped, not guessed
    n = int(run["world_size"])
    share = max(1.0, n / cpus) if (oversubscription and cpus) else 1.0
    net = Network(
        float(run["link_gbit"]),
        latency_s=max(float(run.get("latency_ms", 0.0)) / 1e3 if latency_applied else 0.0, knobs["latency_floor_s"]),
        efficiency=knobs["efficiency"],
        overhead_s=knobs["overhead_s"],
        host_s_per_byte=knobs["host_s_per_byte"],
        contention=share,
    )
    pred = predict(profiles[run["model"]], strategy, n, net, opts, compute_scale=share)
    measured = float(run["median_step_s"])
    steps = [float(x) for x in run.get("step_s") or []]
    # the run's own spread (interquartile range over the median): a noise floor
    spread = float(np.subtract(*np.percentile(steps, [75, 25])) / measured) if len(steps) >= 4 else None
    return {"measured_rel_iqr": spread, "model": run["model"], "world_size": n, "link_gbit": float(run["link_gbit"]),
            "strategy": strategy, "measured_s": measured, "predicted_s": pred.step_s,
            "rel_error": (pred.step_s - measured) / measured}


def _speedups(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Speedup of the subject strategy over each other one, measured and predicted, per setting."""
    speedups = []
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["world_size"], r["link_gbit"]), {})[r["strategy"]] = r
    for (model, n, gbit), g in groups.items():
        e = g.get(SPEEDUP_SUBJECT)
        for name, r in g.items():
            if e is None or name == SPEEDUP_SUBJECT:
                continue
            speedups.append({"model": model, "world_size": n, "link_gbit": gbit, "over": name,
                             "measured": r["measured_s"] / e["measured_s"], "predicted": r["predicted_s"] / e["predicted_s"]})
    return speedups


def _mean_or_none(values: Sequence[float], fn: Callable = np.mean) -> Optional[float]:
    return float(fn(values)) if values else None


def validate_parsed(profiles: Dict[str, Profile], runs: List[dict], meta: dict, knobs: Dict[str, float],
                    tied: Optional[Dict[str, str]], opts: Options, oversubscription: bool) -> dict:
    """:func:`validate` on parsed profiles (reused by the fit, which caches their loads)."""
    if meta.get("fallback_loopback"):
        # no emulated links: the network model has nothing to predict
        return {"runs": [], "skipped": f"runs on loopback ({meta.get('fallback_reason')}), no emulated links",
                "mean_abs_rel_error": None, "median_abs_rel_error": None, "max_abs_rel_error": None, "by_strategy": {}}
    latency_applied = meta.get("latency_applied", True)
    cpus = (meta.get("machine") or {}).get("cpus") or 0
    for name, mode in (tied or {}).items():
        if name not in profiles:
            raise ValueError(f"--tied-output names the unknown model {name!r}")
        profiles[name].tied_output = None if mode == "none" else mode
    rows = [row for row in (_predict_run(run, profiles, knobs, opts, latency_applied, cpus, oversubscription)
                            for run in runs) if row is not None]
    errs = [abs(r["rel_error"]) for r in rows]
    speedups = _speedups(rows)
    by_strategy: Dict[str, List[float]] = {}
    for r in rows:
        by_strategy.setdefault(r["strategy"], []).append(abs(r["rel_error"]))
    iqrs = [r["measured_rel_iqr"] for r in rows]
    return {
        "runs": rows,
        "mean_abs_rel_error": _mean_or_none(errs),
        "median_abs_rel_error": _mean_or_none(errs, np.median),
        "max_abs_rel_error": _mean_or_none(errs, np.max),
        "by_strategy": {k: float(np.mean(v)) for k, v in by_strategy.items()},
        "speedups_of_embrace_schedule": speedups,
        "speedup_mean_abs_rel_error": _mean_or_none([abs(x["predicted"] / x["measured"] - 1) for x in speedups]),
        "median_measured_rel_iqr": (_mean_or_none(iqrs, np.median)
                                    if all(x is not None for x in iqrs) else None),
        "network": dict(knobs, latency_applied=latency_applied, cpus=cpus, oversubscription=oversubscription),
        "options": asdict(opts),
    }


def fit_network(bench: dict, *, tied: Optional[Dict[str, str]] = None, opts: Options = Options(defer_rows=False),
                holdouts: Sequence[str] = ("link_gbit", "model"), grid: Dict[str, Sequence[float]] = FIT_GRID,
                oversubscription: bool = True) -> dict:
    """Fit the network knobs (efficiency, per-collective overhead, host CPU per byte).

    A grid search minimising the mean relative error. For each field in ``holdouts``,
    the runs with each value of it are predicted by knobs fitted on the other runs (an
    out-of-sample error: e.g. 10 Gbit/s predicted from knobs fitted at 1 Gbit/s).
    """
    profiles, runs = runs_and_profiles(bench)  # parsed once: their sparse loads are cached
    meta = bench.get("meta", {})
    cache: Dict[tuple, dict] = {}

    def result(k: tuple) -> dict:
        if k not in cache:
            knobs = dict(zip(grid, k), latency_floor_s=0.0)
            cache[k] = validate_parsed(profiles, runs, meta, knobs, tied, opts, oversubscription)
        return cache[k]

    def mean_err(k: tuple, keep) -> float:
        errs = [abs(r["rel_error"]) for r in result(k)["runs"] if keep(r)]
        return float(np.mean(errs)) if errs else float("inf")

    combos = list(itertools.product(*grid.values()))

    def best(keep) -> tuple:
        return min(combos, key=lambda k: mean_err(k, keep))

    k = best(lambda r: True)
    out = dict(zip(grid, k), in_sample_mean_abs_rel_error=mean_err(k, lambda r: True), holdout={})
    for field_name in holdouts:
        values = sorted({r[field_name] for r in result(k)["runs"]})
        if len(values) < 2:
            continue
        held = []
        for v in values:
            kv = best(lambda r, v=v: r[field_name] != v)
            held += [abs(r["rel_error"]) for r in result(kv)["runs"] if r[field_name] == v]
        out["holdout"][field_name] = float(np.mean(held))
    return out
