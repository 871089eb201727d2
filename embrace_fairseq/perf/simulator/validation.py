"""The model against measured runs: prediction errors (:func:`validate`), a fit of the
network knobs with held-out errors (:func:`fit_network`) and an out-of-sample check
fitted on one model and link (:func:`out_of_sample`), from a bench JSON.

Runs calibrated to a compute-matched regime (``--regime``) carry the regime's name: their
link is the calibrated rate, different per workload and world size, so the regime is
their link's name here (fit on ``(model, regime)``, errors per model and regime), and
whether a run's latency was applied is its calibration's (the ``regimes`` section)."""
from __future__ import annotations

import copy
import itertools
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from embrace_fairseq.perf.bench.keys import record_link, run_key
from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, canonical_strategy, get_strategy

FIT_GRID = {
    "efficiency": (0.5, 0.75, 1.0),
    # up to tens of ms: ranks that share cores wait for each other at every collective
    "overhead_s": (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3),
    "host_s_per_byte": (0.0, 1e-9, 2e-9, 4e-9, 6e-9, 8e-9, 12e-9, 16e-9),
    # ranks sharing a core compute slower than a core split evenly between them (caches,
    # memory bandwidth, switches): the compute of oversubscribed runs is share x this
    "shared_core_slowdown": (1.0, 1.2, 1.4, 1.6, 1.8, 2.0),
}


def runs_and_profiles(bench: dict) -> Tuple[Dict[str, Profile], List[dict]]:
    """The bench JSON's profiles (parsed) and runs.

    A masked-LM workload (``workload_shapes[model]["masked_share"]``) scores only its masked
    positions: its profile's output tokens are that share of its tokens (the bench profiles
    count every position looked up), unless the profile states them. A run calibrated to a
    regime takes ``latency_applied`` from its calibration (``regimes[run key]``)."""
    if "profiles" not in bench or "runs" not in bench:
        raise ValueError("bench JSON needs 'profiles' and 'runs' objects")
    profiles = {name: Profile.from_json(name, d) for name, d in bench["profiles"].items()}
    shapes = bench.get("workload_shapes") or {}
    for name, prof in profiles.items():
        masked = (shapes.get(name) or {}).get("masked_share")
        if prof.output_tokens_per_rank is None and masked:
            prof.output_tokens_per_rank = float(masked) * prof.tokens_per_rank
    calibrations = bench.get("regimes") or {}
    runs = [_with_calibration(r, calibrations) for r in bench["runs"]]
    for name, prof in profiles.items():
        # a profile that does not say: runs that all-gathered the table (or the hidden
        # states, the vocab-parallel path) had a tied output
        paths = {recorded_output_path(r) for r in runs if r.get("model") == name} - {None}
        if "tied_output" not in bench["profiles"][name] and paths:
            prof.tied_output = "gather" if "gather" in paths else "vocab_parallel"
    return profiles, runs


def _with_calibration(run: dict, calibrations: Dict[str, dict]) -> dict:
    """The run, with its regime calibration's ``latency_applied`` where it has one."""
    if not run.get("regime"):
        return run
    cal = calibrations.get(run_key(run["model"], int(run["world_size"]), record_link(run)))
    if not cal or "latency_applied" not in cal:
        return run
    return dict(run, latency_applied=bool(cal["latency_applied"]))


# the ledger's byte kinds that show how a run read a tied output table, first match wins
_OUTPUT_KINDS = (("table_gather", "gather"), ("hidden_gather", "vocab_parallel"))


def recorded_output_path(run: dict) -> Optional[str]:
    """How a run read a tied output table, from the bytes it recorded: ``"gather"`` (the
    table all-gathered), ``"vocab_parallel"`` (the hidden states all-gathered) or None."""
    by_kind = run.get("bytes_per_rank_per_step") or {}
    for kind, path in _OUTPUT_KINDS:
        if by_kind.get(kind, 0) > 0:
            return path
    return None


def _run_profile(run: dict, prof: Profile, strategy: str) -> Profile:
    """The profile as this run used it: the automatic output choice depends on the world
    size, so a sharding run's recorded path overrides the tied profile's."""
    path = recorded_output_path(run)
    if prof.tied_output is None or path in (None, prof.tied_output) or not get_strategy(strategy).shards_table:
        return prof
    run_prof = copy.copy(prof)  # shallow: shares the cached sparse loads
    run_prof.tied_output = path
    return run_prof


def validate(bench: dict, *, latency_floor_s: float = 0.0, efficiency: float = 1.0, overhead_s: float = 0.0,
             host_s_per_byte: float = 0.0, shared_core_slowdown: float = 1.0, tied: Optional[Dict[str, str]] = None,
             opts: Options = Options(defer_rows=False), oversubscription: bool = True) -> dict:
    """Predict every measured run of a bench JSON; relative errors per run and summary.

    By default the schedule is modelled as implemented (no deferral of gradient rows
    into the next forward: the exchange is synchronous in ``ShardedEmbedding``).
    With ``oversubscription`` the compute (measured one process at a time) is scaled
    by ``max(1, N / cpus)`` when N ranks share the machine's ``cpus`` cores, and by
    ``shared_core_slowdown`` more when that share is above 1.
    """
    profiles, runs = runs_and_profiles(bench)
    knobs = {"efficiency": efficiency, "overhead_s": overhead_s, "host_s_per_byte": host_s_per_byte,
             "shared_core_slowdown": shared_core_slowdown, "latency_floor_s": latency_floor_s}
    return validate_parsed(profiles, runs, bench.get("meta", {}), knobs, tied, opts, oversubscription)


def _predict_run(run: dict, profiles: Dict[str, Profile], knobs: Dict[str, float], opts: Options,
                 latency_applied: bool, cpus: int, oversubscription: bool,
                 recorded_path: bool = True) -> Optional[Dict[str, Any]]:
    """One measured run against its prediction; None when it cannot be predicted.
    ``recorded_path``: the output path the run recorded overrides the profile's."""
    if run.get("median_step_s") is None or run.get("model") not in profiles:
        return None
    try:
        strategy = canonical_strategy(str(run["strategy"]))
    except ValueError:
        return None  # unknown strategy names are skipped, not guessed
    n = int(run["world_size"])
    share = max(1.0, n / cpus) if (oversubscription and cpus) else 1.0
    latency_applied = run.get("latency_applied", latency_applied)  # a regime run's calibration says
    net = Network(
        float(run["link_gbit"]),
        latency_s=max(float(run.get("latency_ms") or 0.0) / 1e3 if latency_applied else 0.0, knobs["latency_floor_s"]),
        efficiency=knobs["efficiency"],
        overhead_s=knobs["overhead_s"],
        host_s_per_byte=knobs["host_s_per_byte"],
        contention=share,
    )
    prof = profiles[run["model"]]
    compute_scale = share * knobs.get("shared_core_slowdown", 1.0) if share > 1.0 else 1.0
    pred = predict(_run_profile(run, prof, strategy) if recorded_path else prof, strategy, n, net, opts,
                   compute_scale=compute_scale)
    measured = float(run["median_step_s"])
    steps = [float(x) for x in run.get("step_s") or []]
    # the run's own spread (interquartile range over the median): a noise floor
    spread = float(np.subtract(*np.percentile(steps, [75, 25])) / measured) if len(steps) >= 4 else None
    return {"measured_rel_iqr": spread, "model": run["model"], "world_size": n, "link_gbit": float(run["link_gbit"]),
            "regime": run.get("regime"), "strategy": strategy, "measured_s": measured, "predicted_s": pred.step_s,
            "rel_error": (pred.step_s - measured) / measured}


def _speedups(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Speedup of the subject strategy over each other one, measured and predicted, per setting."""
    speedups = []
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["world_size"], r["link_gbit"], r.get("regime")), {})[r["strategy"]] = r
    for (model, n, gbit, regime), g in groups.items():
        e = g.get(SPEEDUP_SUBJECT)
        for name, r in g.items():
            if e is None or name == SPEEDUP_SUBJECT:
                continue
            speedups.append({"model": model, "world_size": n, "link_gbit": gbit, "regime": regime, "over": name,
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
    # a model whose output was forced keeps it in every run
    rows = [row for row in (_predict_run(run, profiles, knobs, opts, latency_applied, cpus, oversubscription,
                                         run.get("model") not in (tied or {}))
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


class _KnobSearch:
    """The grid search over the network knobs: the profiles parsed once (their sparse
    loads cached) and each grid point's predictions of every run computed once."""

    def __init__(self, bench: dict, tied: Optional[Dict[str, str]], opts: Options,
                 grid: Dict[str, Sequence[float]], oversubscription: bool) -> None:
        self.profiles, self.runs = runs_and_profiles(bench)
        self.meta = bench.get("meta", {})
        self.tied, self.opts, self.grid, self.oversubscription = tied, opts, grid, oversubscription
        self.combos: List[tuple] = list(itertools.product(*grid.values()))
        self._cache: Dict[tuple, dict] = {}

    def knobs(self, k: tuple) -> Dict[str, float]:
        return dict(zip(self.grid, k))

    def result(self, k: tuple) -> dict:
        if k not in self._cache:
            knobs = dict(self.knobs(k), latency_floor_s=0.0)
            self._cache[k] = validate_parsed(self.profiles, self.runs, self.meta, knobs, self.tied, self.opts,
                                             self.oversubscription)
        return self._cache[k]

    def mean_err(self, k: tuple, keep: Callable[[dict], bool]) -> float:
        errs = [abs(r["rel_error"]) for r in self.result(k)["runs"] if keep(r)]
        return float(np.mean(errs)) if errs else float("inf")

    def best(self, keep: Callable[[dict], bool]) -> tuple:
        """The grid point of least mean relative error over the runs ``keep`` selects."""
        return min(self.combos, key=lambda k: self.mean_err(k, keep))


def fit_network(bench: dict, *, tied: Optional[Dict[str, str]] = None, opts: Options = Options(defer_rows=False),
                holdouts: Sequence[str] = ("link_gbit", "model"), grid: Dict[str, Sequence[float]] = FIT_GRID,
                oversubscription: bool = True) -> dict:
    """Fit the knobs (efficiency, per-collective overhead, host CPU per byte, the slowdown of
    ranks sharing a core).

    A grid search minimising the mean relative error. For each field in ``holdouts``,
    the runs with each value of it are predicted by knobs fitted on the other runs (an
    out-of-sample error: e.g. 10 Gbit/s predicted from knobs fitted at 1 Gbit/s); for runs
    calibrated to regimes the regime stands for the link.
    """
    search = _KnobSearch(bench, tied, opts, grid, oversubscription)
    k = search.best(lambda r: True)
    out = dict(search.knobs(k), in_sample_mean_abs_rel_error=search.mean_err(k, lambda r: True), holdout={})
    rows = search.result(k)["runs"]
    if any(r.get("regime") for r in rows):  # regime runs: the regime names the link (rates differ per model)
        holdouts = ["regime" if h == "link_gbit" else h for h in holdouts]
    for field_name in holdouts:
        values = sorted({r[field_name] for r in rows})
        if len(values) < 2:
            continue
        held = []
        for v in values:
            kv = search.best(lambda r, v=v: r[field_name] != v)
            held += [abs(r["rel_error"]) for r in search.result(kv)["runs"] if r[field_name] == v]
        out["holdout"][field_name] = float(np.mean(held))
    return out


# the out-of-sample check's targets: held-out runs of fixed links within 20 % on average;
# runs calibrated to a regime within 15 % on average for every workload
OUT_OF_SAMPLE_TARGET = 0.20
REGIME_TARGET_PER_MODEL = 0.15

#: what ``fit_on`` names the link by: its Gbit/s (fixed links) or a regime's name
FitOn = Tuple[str, Union[float, str]]


def error_summary(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Mean signed, mean and max absolute relative error of prediction rows, and their count."""
    errs = [float(r["rel_error"]) for r in rows]
    return {"count": len(errs), "mean_signed_rel_error": _mean_or_none(errs),
            "mean_abs_rel_error": _mean_or_none(np.abs(errs).tolist()),
            "max_abs_rel_error": _mean_or_none(np.abs(errs).tolist(), np.max)}


def _regimes_of(rows: Sequence[Dict[str, Any]], model: Optional[str] = None) -> List[str]:
    """The regimes of the rows (of one model), in the order they first appear."""
    return list(dict.fromkeys(r["regime"] for r in rows if r.get("regime") and model in (None, r["model"])))


def _default_fit_on(rows: Sequence[Dict[str, Any]], model_order: Sequence[str],
                    regime_order: Sequence[str] = ()) -> FitOn:
    """The first model (in the bench's profiles order) with predicted runs, at its lowest
    link; for runs calibrated to regimes, at its first regime (in the run's order)."""
    model = next(m for m in model_order if any(r["model"] == m for r in rows))
    regimes = _regimes_of(rows, model)
    if regimes:
        return model, next((g for g in regime_order if g in regimes), regimes[0])
    return model, min(r["link_gbit"] for r in rows if r["model"] == model)


def _fit_selection(rows: Sequence[Dict[str, Any]], fit_on: FitOn) -> Dict[str, Any]:
    """The runs the knobs are fitted on, as field values: the (model, link) pair, or the
    (model, regime) pair where the link is named by a regime; narrowed to its lowest world
    size when the pair is all there is (else nothing is held out)."""
    model, link = fit_on
    if isinstance(link, str):
        sel: Dict[str, Any] = {"model": model, "regime": link.strip().lower()}
        what = f"in the regime {link!r}"
        have = _regimes_of(rows)
        known = f" (the runs' regimes: {', '.join(have)})" if have else " (no run of this bench names a regime)"
    else:
        sel = {"model": model, "link_gbit": float(link)}
        what, known = f"at {float(link):g} Gbit/s", ""
    chosen = [r for r in rows if _selected(r, sel)]
    if not chosen:
        raise ValueError(f"no predicted run of model {model!r} {what} to fit on{known}")
    if len(chosen) == len(rows):
        sel["world_size"] = min(r["world_size"] for r in chosen)
    return sel


def _selected(row: Dict[str, Any], sel: Dict[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in sel.items())


def _link_of(row: Dict[str, Any]) -> Union[float, str]:
    """A run's link as the summaries group it: its regime's name, else its Gbit/s."""
    return row.get("regime") or row["link_gbit"]


def _grouped_summaries(rows: Sequence[Dict[str, Any]]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """:func:`error_summary` per model, and per (model, link) in model then link order; a
    link named by a regime gives ``regime`` and, as ``link_gbit``, its runs' median rate
    (calibrated per workload and world size)."""
    by_model: Dict[str, List[Dict[str, Any]]] = {}
    by_link: Dict[Tuple[str, Union[float, str]], List[Dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
        by_link.setdefault((r["model"], _link_of(r)), []).append(r)

    def order(kv):
        (m, link), _ = kv
        return (list(by_model).index(m), isinstance(link, str), link if isinstance(link, str) else float(link))

    per_link = []
    for (m, link), rs in sorted(by_link.items(), key=order):
        if isinstance(link, str):
            per_link.append(dict(model=m, regime=link, link_gbit=float(np.median([r["link_gbit"] for r in rs])),
                                 **error_summary(rs)))
        else:
            per_link.append(dict(model=m, link_gbit=link, **error_summary(rs)))
    return {m: error_summary(rs) for m, rs in by_model.items()}, per_link


def _targets(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The target the held-out runs are judged by: per workload where they were calibrated
    to regimes, over all of them otherwise."""
    if any(r.get("regime") for r in rows):
        return {"target_mean_abs_rel_error": REGIME_TARGET_PER_MODEL, "target_per": "model"}
    return {"target_mean_abs_rel_error": OUT_OF_SAMPLE_TARGET, "target_per": "all held-out runs"}


def _not_held_out(reason: str, rows: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """An out-of-sample result with nothing predicted, and why."""
    return {"skipped": reason, "runs": [], "by_model": {}, "by_model_link": [], "held_out": error_summary([]),
            "held_out_mean_abs_rel_error": None, **_targets(rows), "by_model_within_target": {},
            "within_target": None, "within_20pct": None}


def out_of_sample(bench: dict, *, fit_on: Optional[FitOn] = None, tied: Optional[Dict[str, str]] = None,
                  opts: Options = Options(defer_rows=False), grid: Dict[str, Sequence[float]] = FIT_GRID,
                  oversubscription: bool = True) -> dict:
    """Fit the network knobs on the runs of one (model, link) pair; predict every other run.

    Fitted and profiled: the three network knobs (efficiency, overhead per collective,
    host seconds per byte: :func:`fit_network`'s grid) come from the ``fit_on`` runs only,
    while every model's compute comes from its own measured profile (the bench's
    single-process forward, backward and optimizer times); so a held-out model, or link,
    is predicted from its profile and knobs that never saw it. ``fit_on`` is (model,
    link Gbit/s) or (model, regime name) for runs calibrated to regimes (their rate
    differs per workload; the regime names it); by default the first model of the bench's
    profiles at its lowest link, or at the first regime of the run. Where that pair is
    every run (one model, one link) the fit takes its lowest world size only; with a single
    world size too, nothing is held out and the result says so.

    Errors are (predicted - measured) / measured, negative where the model predicts too
    fast; summaries per model and per (model, link) cover the held-out runs. The target
    (``target_mean_abs_rel_error``, ``within_target``): runs of fixed links, a mean
    absolute error of at most 20 % over all held-out runs; runs calibrated to regimes, at
    most 15 % for every workload (``by_model_within_target``). ``within_20pct`` repeats
    ``within_target`` for the readers of earlier results.
    """
    meta = bench.get("meta", {})
    if meta.get("fallback_loopback"):
        return _not_held_out(f"runs on loopback ({meta.get('fallback_reason')}), no emulated links")
    search = _KnobSearch(bench, tied, opts, grid, oversubscription)
    # which runs can be predicted does not depend on the knobs: any grid point tells
    rows = search.result(search.combos[0])["runs"]
    if not rows:
        return _not_held_out("no measured run the simulator can predict")
    regime_order = list((meta.get("regimes") or {}).get("names") or [])
    sel = _fit_selection(rows, fit_on or _default_fit_on(rows, list(bench["profiles"]), regime_order))
    if all(_selected(r, sel) for r in rows):
        return _not_held_out(f"one model, one link and one world size: nothing to hold out from {sel}", rows)
    k = search.best(lambda r: _selected(r, sel))
    fitted = search.result(k)
    runs = [dict(r, held_out=not _selected(r, sel)) for r in fitted["runs"]]
    held = [r for r in runs if r["held_out"]]
    fit_runs = [r for r in runs if not r["held_out"]]
    by_model, by_model_link = _grouped_summaries(held)
    held_summary = error_summary(held)
    targets = _targets(runs)
    target = targets["target_mean_abs_rel_error"]
    per_model = {m: s["mean_abs_rel_error"] <= target for m, s in by_model.items()}
    within = all(per_model.values()) if targets["target_per"] == "model" else held_summary["mean_abs_rel_error"] <= target
    fitted_on = dict(sel, runs=len(fit_runs))
    if "regime" in sel:  # the fit's calibrated rate (one per world size; their median)
        fitted_on["link_gbit"] = float(np.median([r["link_gbit"] for r in fit_runs]))
    return {
        "skipped": None,
        "fitted_on": fitted_on,
        "knobs": search.knobs(k),
        "compute": "each model's own measured profile (single-process forward, backward, optimizer)",
        "in_sample": error_summary(fit_runs),
        "runs": runs,
        "by_model": by_model,
        "by_model_link": by_model_link,
        "held_out": held_summary,
        "held_out_mean_abs_rel_error": held_summary["mean_abs_rel_error"],
        **targets,
        "by_model_within_target": per_model,
        "within_target": within,
        "within_20pct": within,
        "network": fitted["network"],
    }
