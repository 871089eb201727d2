"""From the ranks' raw records to ``bench.json``, ``report.md`` and the plots.

Per run (model, ranks, link, strategy): the step time of a step is the slowest rank's
(every step ends in a collective, so ranks finish together); the median is over the
timed steps; tokens/s is all ranks' target tokens over the summed step times; bytes
by kind are averaged over ranks and steps. The analytic minimum comes from
:func:`embrace_fairseq.perf.bounds.min_bytes_per_step`, averaged over the same batches.
The simulator is checked out of sample against the runs (:func:`simulator_check`).
The tables (:mod:`.markdown`) and plots (:mod:`.plots`) are written from the result.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from embrace_fairseq.perf.bench.attainable import OVER_FIFO, cores_of, machine_limits
from embrace_fairseq.core.ring_volume import ring_allreduce_bytes
from embrace_fairseq.perf.bench.calibration import BENCH_ELEMENT_BYTES, dependency_limit_steps, limit_steps
from embrace_fairseq.perf.bench.keys import link_key, record_link, run_key  # noqa: F401  (re-exported)
from embrace_fairseq.perf.bench.markdown import markdown
from embrace_fairseq.perf.bench.plots import plots
from embrace_fairseq.perf.bench.regime_goals import regime_goal_check
from embrace_fairseq.perf.bench.workloads import tied_tables
from embrace_fairseq.perf.bench.stats import (CONFIDENCE, INTERVAL_METHODS, RATIO_STATISTIC, faster, no_worse,
                                               paired_ratio_interval, ratio_statistic)
from embrace_fairseq.perf.strategies import FLOOR, REFERENCE, SPEEDUP_SUBJECT, UNSCHEDULED_SUBJECT

# Goal (4 ranks, 1 Gbit/s): speedup of (e) over each strategy, per model; judged on the
# lower end of the ratio's interval where one was computed
_STOCK = ("fairseq_legacy_ddp", "fairseq_c10d", "deepspeed", "deepspeed_zero1", "deepspeed_zero2", "sparse_allgather")
# the 2D schedule against plain (FIFO) overlap with the backward, on the LM and translation
SCHEDULE_OVER_FIFO = {"embrace_fifo": OVER_FIFO}
GOALS = {
    "lm": {"fairseq_legacy_ddp": 2.0, "fairseq_c10d": 2.0, "deepspeed": 2.0, "sparse_allgather": 1.2,
           **SCHEDULE_OVER_FIFO},
    "translation": {**{s: 1.3 for s in _STOCK}, **SCHEDULE_OVER_FIFO},
    "gpt_lm": {s: 1.5 for s in _STOCK},
}
BYTES_GOAL = 1.10
# Shard layouts: the default (strided) layout's step is no slower than the contiguous one's
# at any rank count: the interval of contiguous / strided must reach 1.0 or above
LAYOUT_PAIR = ("embrace_contiguous", SPEEDUP_SUBJECT)
#: the schedule's ablation, in the order each adds a part; FIFO overlap is the baseline
ABLATION = ("embrace_noschedule", "embrace_fifo", "embrace_schedule", "embrace_nogate", "embrace_gate",
            "embrace_next_forward", "embrace_next_forward_gate", "embrace_next_forward_whole", "embrace_relaxed")
ABLATION_BASE = "embrace_fifo"
# the node-aware exchange against the flat one (the subject's) on several ranks per node
NODE_PAIR = ("embrace_node", SPEEDUP_SUBJECT)
NODE_BYTES_GOAL = 0.7  # the exchange's inter-node bytes, node-aware over flat
NODE_STEP_GOAL = 1.1  # flat step over node-aware step, on the untied LM
EXCHANGE_KINDS = ("counts", "ids", "rows", "grad_rows")
# the dense all-reduce in two levels against one ring (the subject's)
TWO_LEVEL_PAIR = ("embrace_two_level", SPEEDUP_SUBJECT)
# exchange phases and the side of each that the shard layout decides (owners serve rows
# in forward and receive gradient rows in backward)
EXCHANGE_PHASES = (("rows", "sent"), ("grad_rows", "received"))


def exchange_balance(per_rank: List[Dict[str, Any]], steps: int) -> Optional[Dict[str, Any]]:
    """Per exchange phase, the busiest rank next to the mean: the owner-side bytes per step
    (rows sent in forward, gradient rows received in backward) and the AlltoAll seconds per
    step (from the ranks' trace summaries, when traced). None without per-rank ledgers."""
    out: Dict[str, Any] = {}
    for phase, side in EXCHANGE_PHASES:
        key = "bytes_by_kind" if side == "sent" else "bytes_received_by_kind"
        if not all(key in pr for pr in per_rank):
            continue
        owner = [float(pr[key].get(phase, 0.0)) for pr in per_rank]
        other_key = "bytes_received_by_kind" if side == "sent" else "bytes_by_kind"
        other = [float(pr.get(other_key, {}).get(phase, 0.0)) for pr in per_rank]
        mean = statistics.fmean(owner)
        if mean <= 0:
            continue
        entry: Dict[str, Any] = {
            "owner_side": side, "bytes_max": max(owner), "bytes_mean": mean, "bytes_max_over_mean": max(owner) / mean,
            "link_max_over_mean": max(max(a, b) for a, b in zip(owner, other)) / mean,
            "bytes_per_rank": owner,
        }
        secs = [(pr.get("trace_summary") or {}).get("seconds_by_kind", {}).get(phase) for pr in per_rank]
        if all(s is not None for s in secs) and steps:
            secs = [s / steps for s in secs]
            sm = statistics.fmean(secs)
            entry.update({"alltoall_s_max": max(secs), "alltoall_s_mean": sm,
                          "alltoall_s_max_over_mean": max(secs) / sm if sm > 0 else None})
        out[phase] = entry
    return out or None


def output_path(name: str, tied: bool, vocab: int, dim: int, tokens: List[int]) -> Optional[str]:
    """How the strategy reads a tied output table in a step with these target tokens per
    rank (the bounds' ``tied_output``): the stock ones whole (``"gather"``); EmbRace's by
    the automatic choice the model makes from the same counts."""
    from embrace_fairseq.core.vocab_parallel import VOCAB_PARALLEL, output_bytes
    from embrace_fairseq.perf.strategies import get_strategy

    if not tied:
        return None
    if not get_strategy(name).shards_table:
        return "gather"
    return "vocab_parallel" if output_bytes(vocab, dim, tokens, smoothing=False).choose() == VOCAB_PARALLEL else "gather"


def _min_bytes(name: str, world: int, prof: Dict[str, Any], ids: List[List[List[Any]]], tied: List[bool],
               meta: Dict[str, Any], tokens: List[List[int]]) -> Optional[float]:
    """The analytic minimum of ``name`` averaged over the steps' ids (and target tokens);
    ``ids[step][rank][table]``, ``tied[table]``: several token tables (an encoder's and a
    decoder's) each add their own minimum, the dense parameters counted once; None (said
    in meta) when unknown."""
    from embrace_fairseq.perf.bounds import min_bytes_per_step  # torch: imported when a report is assembled

    try:
        totals = [sum(min_bytes_per_step(name, world_size=world, vocab=t["vocab"], dim=t["dim"],
                                         dense_numel=prof["dense_numel"] if ti == 0 else 0,
                                         ids_per_rank=[rank_ids[ti] for rank_ids in step_ids],
                                         tied_output=output_path(name, tied[ti], t["vocab"], t["dim"], step_tokens),
                                         tokens_per_rank=step_tokens)["total"]
                      for ti, t in enumerate(_tables(prof)))
                  for step_ids, step_tokens in zip(ids, tokens)]
    except Exception as exc:  # a strategy the bounds do not know: say so
        meta.setdefault("bounds_errors", {})[name] = f"{type(exc).__name__}: {exc}"
        return None
    return statistics.fmean(totals)


def _tables(prof: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The profile's token tables (profiles of one table did not list them)."""
    return prof.get("tables") or [{"vocab": prof["vocab"], "dim": prof["dim"]}]


def _run_record(name: str, per_rank: List[Dict[str, Any]], model: str, world: int, link: Dict[str, float],
                min_b: Optional[float], ranks_per_node: int = 1) -> Dict[str, Any]:
    """One (model, ranks, link, strategy) run from its ranks' records. With several ranks
    per node, every rank of a node read the node's NIC: its wire bytes are the node's."""
    n_steps = len(per_rank[0]["step_s"])
    step_s = [max(pr["step_s"][i] for pr in per_rank) for i in range(n_steps)]
    cpu_s = ([sum(pr["cpu_s"][i] for pr in per_rank) for i in range(n_steps)]
             if n_steps and all("cpu_s" in pr for pr in per_rank) else None)
    tokens = sum(pr["tokens"] for pr in per_rank)
    kinds = sorted({k for pr in per_rank for k in pr["bytes_by_kind"]})
    by_kind = {k: statistics.fmean(pr["bytes_by_kind"].get(k, 0.0) for pr in per_rank) for k in kinds}
    counted = sorted({k for pr in per_rank for k in pr["counted_bytes_by_op"]})
    wire = [pr["wire_bytes_per_step"] for pr in per_rank]
    hidden = [pr.get("hidden_share") for pr in per_rank if pr.get("hidden_share") is not None]
    total = sum(by_kind.values())
    inter = None
    if all("inter_node_bytes_by_kind" in pr for pr in per_rank):
        ikinds = sorted({k for pr in per_rank for k in pr["inter_node_bytes_by_kind"]})
        inter = {k: ranks_per_node * statistics.fmean(pr["inter_node_bytes_by_kind"].get(k, 0.0) for pr in per_rank)
                 for k in ikinds}
    wire_node = None if any(x is None for x in wire) else statistics.fmean(wire)
    return {
        "model": model, "world_size": world, "link_gbit": link["gbit"], "latency_ms": link["latency_ms"],
        "regime": link.get("regime"), "strategy": name, "median_step_s": statistics.median(step_s), "step_s": step_s,
        "tokens_per_s": tokens / sum(step_s),
        # CPU time the ranks' processes used per step, all their threads, summed over ranks:
        # on ranks that share cores, work that any rank adds slows every rank's step
        "cpu_s_per_step": (statistics.fmean(cpu_s) if cpu_s else None),
        "cpu_s": cpu_s,
        "bytes_per_rank_per_step": by_kind, "bytes_total_per_rank_per_step": total,
        "collective_bytes_by_op": {k: statistics.fmean(pr["counted_bytes_by_op"].get(k, 0.0)
                                                       for pr in per_rank) for k in counted},
        "ranks_per_node": ranks_per_node,
        "wire_bytes_per_rank_per_step": None if wire_node is None else wire_node / ranks_per_node,
        "wire_bytes_per_node_per_step": wire_node,
        "inter_node_bytes_per_node_per_step": inter,
        "min_bytes_per_rank_per_step": min_b,
        "bytes_over_min": (total / min_b) if min_b else None,
        "hidden_share": statistics.fmean(hidden) if hidden else None,
        # the settings the strategy was built with (its buckets scaled with the model), the
        # collectives it issued per step (the buckets those settings made) and its warm-up
        "settings": per_rank[0].get("settings"),
        "collectives_per_step_by_op": {k: statistics.fmean(pr.get("calls_per_step_by_op", {}).get(k, 0.0)
                                                           for pr in per_rank)
                                       for k in sorted({k for pr in per_rank
                                                        for k in pr.get("calls_per_step_by_op", {})})},
        "warmup_step_s": per_rank[0].get("warmup_step_s") or None,
        "exchange_balance": exchange_balance(per_rank, n_steps),
        "trace": per_rank[0].get("trace"),
        "loss": per_rank[0]["loss"],
    }


def _by_key(runs: List[Dict[str, Any]]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    return {(run_key(r["model"], r["world_size"], record_link(r)), r["strategy"]): r for r in runs}


def _ratio_intervals(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Each strategy's step over the subject's (:data:`.stats.RATIO_STATISTIC` of the timed
    steps' paired ratios: their geometric mean), per run key, with its interval (:mod:`.stats`: a t interval on
    the log paired ratios):
    every strategy steps through the same batches, so step ``i`` of one pairs with step
    ``i`` of the other."""
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    by = _by_key(runs)
    for (key, s), r in by.items():
        e = by.get((key, SPEEDUP_SUBJECT))
        if e and s != SPEEDUP_SUBJECT:
            out.setdefault(key, {})[s] = paired_ratio_interval(r["step_s"], e["step_s"])
    return out


def _ratios(intervals: Dict[str, Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """The point ratios of :func:`_ratio_intervals`."""
    return {key: {s: iv["ratio"] for s, iv in per.items()} for key, per in intervals.items()}


def layout_check(runs: List[Dict[str, Any]],
                 intervals: Optional[Dict[str, Dict[str, Dict[str, float]]]] = None) -> Dict[str, Any]:
    """Per run key where both layouts ran: contiguous step / strided step with its interval
    (the one :func:`_ratio_intervals` computed, given or computed here), and the exchange's
    busiest rank over the mean for each. Met when the interval's lower end shows strided at
    most :data:`.stats.NO_WORSE_MARGIN` slower (a non-inferiority test)."""
    out: Dict[str, Any] = {}
    by = _by_key(runs)
    intervals = _ratio_intervals(runs) if intervals is None else intervals
    contiguous, strided = LAYOUT_PAIR  # strided is the subject: its ratios are the intervals'
    for (key, s), c in by.items():
        e = by.get((key, strided))
        if s != contiguous or e is None:
            continue
        iv = intervals[key][contiguous]
        bal = {}
        for name, r in ((contiguous, c), (strided, e)):
            eb = r.get("exchange_balance") or {}
            bal[name] = {ph: eb[ph]["bytes_max_over_mean"] for ph in eb}
        out[key] = {"contiguous_over_strided": iv, "no_worse": no_worse(iv), "better": faster(iv),
                    "owner_bytes_max_over_mean": bal}
    return out


def schedule_ablation(runs: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Per run key where FIFO overlap ran: each ablation variant's median step, FIFO's
    step over the variant's with its interval (:mod:`.stats`) (above 1: the
    variant is faster), its hidden share and its step over the compute-only floor."""
    by = _by_key(runs)
    out: Dict[str, List[Dict[str, Any]]] = {}
    for (key, s), base in by.items():
        if s != ABLATION_BASE:
            continue
        floor = by.get((key, FLOOR))
        rows = []
        for name in ABLATION:
            r = by.get((key, name))
            if r is None:
                continue
            rows.append({"strategy": name, "median_step_s": r["median_step_s"],
                         "fifo_over_variant": paired_ratio_interval(base["step_s"], r["step_s"]),
                         "hidden_share": r.get("hidden_share"),
                         "over_floor": r["median_step_s"] / floor["median_step_s"] if floor else None})
        out[key] = rows
    return out


def attainable_check(runs: List[Dict[str, Any]], meta: Dict[str, Any]) -> Dict[str, Any]:
    """Per run key where FIFO overlap and the floor ran with CPU times: the schedule's step
    goals against what the ranks' cores allow (:mod:`.attainable`), the ablation's
    variants taken as the same work."""
    by = _by_key(runs)
    out: Dict[str, Any] = {}
    for key in sorted({k for k, s in by if s == ABLATION_BASE}):
        per = {s: r for (k, s), r in by.items() if k == key}
        lim = machine_limits(per, cores_of(meta), ABLATION, ABLATION_BASE, FLOOR, ratio_statistic(meta))
        if lim is not None:
            out[key] = lim
    return out


def node_exchange_check(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per run key on several ranks per node where the node-aware exchange ran beside the
    subject (flat exchange): the exchange's inter-node bytes per node and step of each,
    node-aware over flat (goal: at most :data:`NODE_BYTES_GOAL`), and the flat step over
    the node-aware one with its paired interval (goal on the untied LM: lower end at
    least :data:`NODE_STEP_GOAL`)."""
    by = _by_key(runs)
    out: Dict[str, Any] = {}
    for (key, s), node in by.items():
        flat = by.get((key, NODE_PAIR[1]))
        if s != NODE_PAIR[0] or flat is None or node.get("ranks_per_node", 1) < 2:
            continue
        fb, nb = (sum((r.get("inter_node_bytes_per_node_per_step") or {}).get(k, 0.0) for k in EXCHANGE_KINDS)
                  for r in (flat, node))
        iv = paired_ratio_interval(flat["step_s"], node["step_s"])
        entry: Dict[str, Any] = {
            "flat_exchange_inter_node_bytes": fb, "node_exchange_inter_node_bytes": nb,
            "bytes_node_over_flat": nb / fb if fb else None, "flat_over_node_step": iv,
            "bytes_met": (nb / fb <= NODE_BYTES_GOAL) if fb else None,
        }
        if node["model"] == "lm":
            entry["step_met"] = iv["low"] >= NODE_STEP_GOAL
        out[key] = entry
    return out


def two_level_check(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per run key on several ranks per node where both ran: the dense all-reduce's
    inter-node bytes per node and step in two levels (``embrace_two_level``) and in one
    ring (the subject, the same otherwise), and the ring's step over the two-level one
    with its paired interval (above 1: two levels are faster)."""
    by = _by_key(runs)
    out: Dict[str, Any] = {}
    for (key, s), two in by.items():
        ring = by.get((key, TWO_LEVEL_PAIR[1]))
        if s != TWO_LEVEL_PAIR[0] or ring is None or two.get("ranks_per_node", 1) < 2:
            continue
        dense = [(r.get("inter_node_bytes_per_node_per_step") or {}).get("dense_allreduce", 0.0) for r in (ring, two)]
        out[key] = {"ring_dense_inter_node_bytes": dense[0], "two_level_dense_inter_node_bytes": dense[1],
                    "ring_over_two_level_step": paired_ratio_interval(ring["step_s"], two["step_s"])}
    return out


def regime_check(runs: List[Dict[str, Any]], calibrations: Dict[str, Dict[str, Any]],
                 profiles: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Per run key calibrated to a regime: the calibration (real model, measured floor,
    scale, link, latency) and the limit: per timed step of the floor, the floor's step or
    the least minimum bytes of the run's strategies (EmbRace's) over the link, whichever is
    longer (:func:`.calibration.limit_steps`); each strategy's step over it, with the
    interval (:mod:`.stats`; step ``i`` against the limit of the floor's step ``i``). Where
    the model's profile timed its output stretch (:mod:`.stretch`), the dependency-aware
    limit beside it (:func:`.calibration.dependency_limit_steps`, ``dependency_limit``)."""
    by = _by_key(runs)
    out: Dict[str, Any] = {}
    for key, cal in calibrations.items():
        per = {s: r for (k, s), r in by.items() if k == key}
        floor = per.get(FLOOR)
        entry: Dict[str, Any] = dict(cal, limit=None)
        mins = {s: r["min_bytes_per_rank_per_step"] for s, r in per.items()
                if s != FLOOR and r.get("min_bytes_per_rank_per_step") is not None}
        if floor is not None and mins:
            least = min(mins, key=mins.get)
            steps = limit_steps(floor["step_s"], mins[least], floor["link_gbit"])
            wire_s = mins[least] / (floor["link_gbit"] * 1e9 / 8)
            limit = statistics.fmean(steps)
            entry["limit"] = {
                "limit_s": limit, "limit_steps_s": steps, "floor_s": statistics.fmean(floor["step_s"]),
                "min_bytes": mins[least], "min_bytes_of": least, "min_bytes_over_link_s": wire_s,
                "bound_by": "link" if wire_s > statistics.fmean(floor["step_s"]) else "compute",
                "over_limit": {s: paired_ratio_interval(r["step_s"], steps) for s, r in per.items()},
            }
            prof = (profiles or {}).get(floor["model"]) or {}
            if prof.get("stretch"):
                entry["dependency_limit"] = dependency_limit(
                    per, floor, prof["stretch"]["share"], prof["dense_numel"], mins[least])
        out[key] = entry
    return out


def dependency_limit(per: Dict[str, Dict[str, Any]], floor: Dict[str, Any], stretch_share: float,
                     dense_numel: int, min_bytes: float) -> Dict[str, Any]:
    """The dependency-aware limit of one run (``per``: its strategies' records) and every
    strategy's step over it: the output stretch (``stretch_share`` of each floor step) plus
    the dense parameters' ring all-reduce (fp32) over the link, where longer than the plain
    limit."""
    dense = ring_allreduce_bytes(dense_numel * BENCH_ELEMENT_BYTES, floor["world_size"])
    steps = dependency_limit_steps(floor["step_s"], stretch_share, dense, min_bytes, floor["link_gbit"])
    return {"limit_s": statistics.fmean(steps), "limit_steps_s": steps, "stretch_share": stretch_share,
            "stretch_s": stretch_share * statistics.fmean(floor["step_s"]), "dense_bytes": dense,
            "dense_over_link_s": dense / (floor["link_gbit"] * 1e9 / 8),
            "over_limit": {s: paired_ratio_interval(r["step_s"], steps) for s, r in per.items()}}


def workload_shapes(models: List[str]) -> Dict[str, Any]:
    """Each workload's shape, where :mod:`.workloads` describes them (``workload_shape``)."""
    from embrace_fairseq.perf.bench import workloads as W

    if not hasattr(W, "workload_shape"):
        return {}
    out = {}
    for m in models:
        try:
            out[m] = W.workload_shape(m)
        except Exception as exc:  # noqa: BLE001  (a shape it cannot give is said, the results kept)
            out[m] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def assemble(meta: Dict[str, Any], raw: List[Dict[str, Any]], batches: Dict[Tuple[str, int], Any],
             quick: bool) -> Dict[str, Any]:
    meta = dict(meta, bounds="perf.bounds.min_bytes_per_step", ratio_statistic=RATIO_STATISTIC,
                interval_method=INTERVAL_METHODS[RATIO_STATISTIC])
    # the machine's 1-minute load, sampled after every round of every launch
    load = [x for launch in raw for link in launch["ranks"][0]["links"] for x in link.get("load_1min", [])]
    if load:
        meta["machine"] = dict(meta["machine"], load_during_run={"min": min(load), "max": max(load),
                                                                 "samples": len(load)})
    profiles: Dict[str, Any] = {}
    runs: List[Dict[str, Any]] = []
    consistency: Dict[str, Any] = {}
    for launch in raw:
        model, world, ranks = launch["model"], launch["world_size"], launch["ranks"]
        prof = ranks[0].get("compute_profile", {})
        pm = profiles.setdefault(model, {"vocab": prof["vocab"], "dim": prof["dim"], "dense_numel": prof["dense_numel"],
                                         "dense_layers": prof["dense_layers"], "_compute": [],
                                         "_tokens": [], "_paths": [], "unique_ids_per_rank": {}})
        pm["_compute"].append(prof["compute_s"])
        if prof.get("stretch"):
            pm.setdefault("_stretch", []).append(prof["stretch"])
        b = batches[(model, world)]
        tied = tied_tables(b.workload)  # per table: does the output projection read it
        out_table = _tables(prof)[-1]  # the one a tied output projection reads
        for li, link_rec in enumerate(ranks[0]["links"]):
            link = link_rec["link"]
            names = list(link_rec["strategies"])
            steps = link_rec["strategies"][names[0]]["batch_steps"]
            ids = [[b.table_ids(s, r) for r in range(world)] for s in steps]
            tokens = [[b.target_tokens(s, r) for r in range(world)] for s in steps]
            pm["_paths"] += [output_path(SPEEDUP_SUBJECT, tied[-1], out_table["vocab"], out_table["dim"], t)
                             for t in tokens]
            if li == 0:  # over all tables, in one id space (the simulator's view)
                pm["unique_ids_per_rank"][str(world)] = [
                    statistics.fmean(float(b.ids(s, r).unique().numel()) for s in steps) for r in range(world)]
            losses = {}
            for name in names:
                per_rank = [rk["links"][li]["strategies"][name] for rk in ranks]
                pm["_tokens"].append(sum(pr["tokens"] for pr in per_rank) / (world * len(per_rank[0]["step_s"])))
                runs.append(_run_record(name, per_rank, model, world, link,
                                        _min_bytes(name, world, prof, ids, tied, meta, tokens),
                                        int((meta.get("topology") or {}).get("ranks_per_node", 1))))
                losses[name] = per_rank[0]["loss"]
            # the reference trains synchronously: never the floor, whose ranks train apart
            synchronous = [l for n, l in losses.items() if n != FLOOR] or list(losses.values())
            ref = losses.get(REFERENCE) or synchronous[0]
            consistency[run_key(model, world, link)] = {
                n: max(abs(x - y) / max(1e-12, abs(y)) for x, y in zip(l, ref)) for n, l in losses.items()}
    for pm in profiles.values():
        comp = pm.pop("_compute")
        pm["compute_s"] = {k: statistics.median(c[k] for c in comp) for k in ("forward", "backward", "optimizer")}
        pm["tokens_per_rank"] = int(round(statistics.fmean(pm.pop("_tokens"))))
        stretches = pm.pop("_stretch", None)
        if stretches:  # every launch's profile of the model: the median share
            mid = statistics.median(x["share"] for x in stretches)
            pm["stretch"] = min(stretches, key=lambda x: abs(x["share"] - mid))
        # for the simulator: how EmbRace's automatic choice read a tied table in most steps
        # (None: untied); a run's own recorded bytes say it per world size
        pm["tied_output"] = statistics.mode(pm.pop("_paths") or [None])
    intervals = _ratio_intervals(runs)
    calibrations = {run_key(launch["model"], launch["world_size"], {"regime": c["regime"]}): c
                    for launch in raw for c in launch.get("calibration") or []}
    result = {"meta": meta, "profiles": profiles, "runs": runs, "ratios": _ratios(intervals),
              "regimes": regime_check(runs, calibrations, profiles),
              "workload_shapes": workload_shapes(list(dict.fromkeys(launch["model"] for launch in raw))),
              "ratio_intervals": intervals, "confidence": CONFIDENCE,
              "layouts": layout_check(runs, intervals), "schedule_ablation": schedule_ablation(runs),
              "attainable": attainable_check(runs, meta),
              "nodes": node_exchange_check(runs), "two_level": two_level_check(runs),
              "loss_max_rel_diff_vs_legacy_ddp": consistency}
    result["goal"] = goal_check(result)
    result["simulator"] = simulator_check(result)
    result["regime_goals"] = regime_goal_check(result)
    return result


def simulator_check(result: Dict[str, Any]) -> Dict[str, Any]:
    """The simulator out of sample on this result's runs: network knobs fitted on one model
    and link, every other run predicted (:func:`...simulator.validation.out_of_sample`).
    A failure is recorded in its place: it never costs the measured result."""
    try:
        from embrace_fairseq.perf.simulator.validation import out_of_sample

        return out_of_sample(result)
    except Exception as exc:  # noqa: BLE001  (whatever the simulator raises, the measurements are kept)
        return {"error": f"{type(exc).__name__}: {exc}"}


def goal_check(result: Dict[str, Any]) -> Dict[str, Any]:
    """The targets at 4 ranks, 1 Gbit/s: met or missed, by how much."""
    out: Dict[str, Any] = {}
    runs = result["runs"]
    for model, targets in GOALS.items():
        sel = [r for r in runs if r["model"] == model and r["world_size"] == 4 and r["link_gbit"] == 1.0]
        if not sel:
            continue
        by = {r["strategy"]: r for r in sel}
        e = by.get(SPEEDUP_SUBJECT)
        if e is None:
            continue
        g: Dict[str, Any] = {}
        key = run_key(model, 4, {"gbit": 1.0, "latency_ms": sel[0]["latency_ms"]})
        for s, target in targets.items():
            if s in by:
                iv = result.get("ratio_intervals", {}).get(key, {}).get(s)
                ratio = iv["ratio"] if iv else by[s]["median_step_s"] / e["median_step_s"]
                judged = iv["low"] if iv else ratio
                g[f"speedup_over_{s}"] = {"target": target, "measured": ratio, "met": judged >= target,
                                          "interval": [iv["low"], iv["high"]] if iv else None,
                                          "judged_on": "interval low" if iv else "median ratio",
                                          "shortfall": max(0.0, target - judged)}
        if UNSCHEDULED_SUBJECT in by:
            ratio = by[UNSCHEDULED_SUBJECT]["median_step_s"] / e["median_step_s"]
            g["schedule_vs_noschedule"] = {"target": ">1", "measured": ratio, "met": ratio > 1.0,
                                           "hidden_share": e["hidden_share"],
                                           "hidden_share_noschedule": by[UNSCHEDULED_SUBJECT]["hidden_share"]}
        if e.get("bytes_over_min") is not None:
            g["bytes_over_min"] = {"target": BYTES_GOAL, "measured": e["bytes_over_min"],
                                   "met": e["bytes_over_min"] <= BYTES_GOAL}
        else:
            g["bytes_over_min"] = {"target": BYTES_GOAL, "measured": None, "met": None,
                                   "note": "bounds unavailable"}
        out[model] = g
    return out


def write_outputs(result: Dict[str, Any], out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths += plots(result, out)
    md = out / "report.md"
    md.write_text(markdown(result, [p.name for p in paths if p.suffix == ".png"]))
    paths.append(md)
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m embrace_fairseq.perf.bench.report DIR...``: write each folder's plots and
    ``report.md`` again from its ``bench.json`` (the measured figures are not touched; a
    report written later says so, with the commit that wrote it; what the cores allow is
    derived again from the runs)."""
    import argparse

    from embrace_fairseq.perf.provenance import source_state

    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench.report", description=main.__doc__)
    ap.add_argument("dirs", nargs="+", type=Path)
    for d in ap.parse_args(argv).dirs:
        result = json.loads((d / "bench.json").read_text())
        result["meta"]["report_written_by"] = source_state()
        # derived from the runs, not measured: computed again by the code writing the report
        result["attainable"] = attainable_check(result["runs"], result["meta"])
        result["regime_goals"] = regime_goal_check(result)
        paths = write_outputs(result, d)
        print(f"rewrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
