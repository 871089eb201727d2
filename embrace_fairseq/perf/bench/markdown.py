"""``report.md`` of a benchmark result: setup, profiles, a table per run, the goal, the
simulator out of sample."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from embrace_fairseq.perf.bench.keys import record_link, run_key
from embrace_fairseq.perf.bench.regime_goals import drift_flag, goals_markdown
from embrace_fairseq.perf.bench.stats import NO_WORSE_MARGIN, STATISTIC_WORDS, interval_method, ratio_statistic, verdict
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, STRATEGIES, get_strategy


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _setup(meta: Dict[str, Any]) -> List[str]:
    L = [f"# EmbRace benchmark ({meta['mode']} mode)", ""]
    src = meta.get("source") or {}
    if src.get("commit"):
        L.append(f"Measured on commit `{src['commit']}`" + (" with uncommitted changes" if src.get("dirty") else "")
                 + ".")
    later = meta.get("report_written_by") or {}
    if later.get("commit") and later["commit"] != src.get("commit"):
        L.append(f"This report was written again from `bench.json` by commit `{later['commit']}` (report code "
                 "only; the figures are the measured ones).")
    L.append(f"Command: `{meta['command']}`; wall {meta['wall_s'] or 0:.0f} s; versions "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".")
    L.append("")
    if meta["fallback_loopback"]:
        L.append(f"**FALLBACK: loopback, no emulated links** ({meta['fallback_reason']}). Communication is "
                 "nearly free here; these figures do not show link-bound behaviour.")
    elif meta.get("regimes"):
        k = int((meta.get("topology") or {}).get("ranks_per_node", 1))
        L.append(f"Emulated cluster: one network namespace per {'rank' if k == 1 else f'node of {k} ranks'}, "
                 f"each link shaped in both directions ({meta['link']['shaping']}) at the rate each regime's "
                 f"calibration set ({', '.join(meta['regimes']['names'])}; section \"Compute-matched regimes\").")
    else:
        k = int((meta.get("topology") or {}).get("ranks_per_node", 1))
        per = ("one network namespace per rank" if k == 1 else
               f"one network namespace per node of {k} ranks (ranks of a node talk unshaped inside it)")
        L.append(f"Emulated cluster: {per}, veth to a bridge in a switch namespace, "
                 f"each {'rank' if k == 1 else 'node'}'s link shaped in both directions ({meta['link']['shaping']}); rates "
                 f"{', '.join(f'{g:g}' for g in meta['link']['gbit'])} Gbit/s"
                 + ("" if meta["latency_applied"] else
                    f"; the {meta['link']['latency_ms']:g} ms latency was NOT applied (this kernel has no sch_netem)")
                 + ".")
    cpus = meta["machine"]["cpus"]
    during = meta["machine"].get("load_during_run")
    L.append(f"Machine: {cpus} CPU cores, 1 torch thread per rank, load at start "
             f"{', '.join(f'{x:.2f}' for x in meta['machine']['load_at_start'])}"
             + (f", during the run {during['min']:.2f}-{during['max']:.2f} (1-minute load, "
                f"{during['samples']} samples: after every link of every round)" if during else "") + ". "
             + ("4 ranks oversubscribe the cores: compute is slower than on 4 real nodes." if cpus and cpus < 4 else ""))
    if meta.get("pin_cores"):
        L.append("Ranks pinned: rank r runs on core r % the cores (`--pin-cores`).")
    L.append(f"Memory allocator of the ranks: {meta.get('allocator') or 'glibc malloc (not recorded: before --allocator)'}.")
    s = meta["schedule"]
    L.append(f"Steps: {s['warmup']} warm-up, then {s['rounds']} rounds x {s['steps_per_round']} timed steps per strategy and link speed, "
             f"interleaved ({s['interleaving']}); step time = slowest rank's, after a barrier. "
             f"Bounds: {meta['bounds']}.")
    L.append("")
    return L


def _profiles(result: Dict[str, Any]) -> List[str]:
    L = []
    for model, p in result["profiles"].items():
        c = p["compute_s"]
        L.append(f"**{model}**: vocab {p['vocab']:,}, dim {p['dim']}, table {p['vocab'] * p['dim']:,} params, "
                 f"dense {p['dense_numel']:,} params, {p['tokens_per_rank']} target tokens per rank per step; "
                 f"single-process compute forward {c['forward']:.3f} s, backward {c['backward']:.3f} s, "
                 f"optimizer {c['optimizer']:.3f} s; unique ids per rank: "
                 + "; ".join(f"{w} ranks {statistics.fmean(v):.0f}" for w, v in p["unique_ids_per_rank"].items()) + ".")
    L.append("")
    return L


def _interval(iv: Optional[Dict[str, float]]) -> str:
    return "" if not iv else f" [{iv['low']:.2f}, {iv['high']:.2f}]"


def _run_row(r: Dict[str, Any], ratios: Dict[str, float], drift: Dict[str, float],
             intervals: Dict[str, Dict[str, float]]) -> str:
    kinds = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(r["bytes_per_rank_per_step"].items(),
                                                               key=lambda kv: -kv[1]) if v >= 1e3)
    over = "-" if r["bytes_over_min"] is None else f"{r['bytes_over_min']:.2f}"
    hid = "-" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.0f}%"
    sp = ("-" if r["strategy"] == SPEEDUP_SUBJECT else
          f"{ratios.get(r['strategy'], float('nan')):.2f}x{_interval(intervals.get(r['strategy']))}")
    cpu = "-" if r.get("cpu_s_per_step") is None else f"{r['cpu_s_per_step']:.2f}"
    return (f"| {get_strategy(r['strategy']).label} | {r['median_step_s']:.3f} | {cpu} | {r['tokens_per_s']:.0f} | "
            f"{_mb(r['bytes_total_per_rank_per_step'])} ({kinds or '-'}) | "
            f"{_mb(r['wire_bytes_per_rank_per_step'])} | {over} | {hid} | {sp} | "
            f"{drift.get(r['strategy'], 0.0):.1e} |")


def _run_tables(result: Dict[str, Any]) -> List[str]:
    L = []
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in result["runs"]:
        groups.setdefault(run_key(r["model"], r["world_size"], record_link(r)), []).append(r)
    for key, rs in groups.items():
        L.append(f"## {key}")
        L.append("")
        L.append("| strategy | median step s | CPU s/step | tokens/s | MB sent/rank/step (by kind) | wire MB | bytes/min | hidden | (e) speedup | loss drift |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        ratios = result["ratios"].get(key, {})
        drift = result["loss_max_rel_diff_vs_legacy_ddp"].get(key, {})
        intervals = result.get("ratio_intervals", {}).get(key, {})
        ordered = sorted(rs, key=lambda r: STRATEGIES.index(r["strategy"]))
        L += [_run_row(r, ratios, drift, intervals) for r in ordered]
        L.append("")
        L += _balance_table([r for r in ordered if r.get("exchange_balance")])
    return L


def _balance_table(runs: List[Dict[str, Any]]) -> List[str]:
    """The busiest rank next to the mean, per exchange phase (the shard layout's effect)."""
    if not runs:
        return []
    L = ["Exchange balance (busiest rank vs mean, per step; owner side: rows sent in forward, "
         "gradient rows received in backward):", "",
         "| strategy | phase | KB max | KB mean | max/mean | link max/mean | AlltoAll ms max | ms mean | max/mean |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for phase, b in r["exchange_balance"].items():
            t = (f"{1e3 * b['alltoall_s_max']:.2f} | {1e3 * b['alltoall_s_mean']:.2f} | "
                 f"{b['alltoall_s_max_over_mean']:.2f}") if b.get("alltoall_s_max") is not None else "- | - | -"
            L.append(f"| {get_strategy(r['strategy']).label} | {phase} | {b['bytes_max'] / 1e3:.1f} | "
                     f"{b['bytes_mean'] / 1e3:.1f} | {b['bytes_max_over_mean']:.2f} | "
                     f"{b['link_max_over_mean']:.2f} | {t} |")
    L.append("")
    return L


def _goal_line(model: str, k: str, v: Dict[str, Any]) -> str:
    m = v.get("measured")
    state = "met" if v.get("met") else ("n/a" if v.get("met") is None else "MISSED")
    extra = ""
    if v.get("interval"):
        lo, hi = v["interval"]
        extra = f" [{lo:.2f}, {hi:.2f}], judged on the interval's lower end"
    if k.startswith("speedup") and not v["met"]:
        extra += f" (short by {v['shortfall']:.2f}x)"
    if k == "schedule_vs_noschedule":
        hs = v.get("hidden_share")
        extra = f"; hidden share of communication {'-' if hs is None else f'{100 * hs:.0f}%'} with the schedule"
    return f"- {model}, {k}: target {v['target']}, measured {'-' if m is None else f'{m:.2f}'} -> {state}{extra}"


def _why(result: Dict[str, Any], model: str) -> List[str]:
    """Where the subject strategy's bytes and time go at 4 ranks, 1 Gbit/s."""
    meta = result["meta"]
    sel = {r["strategy"]: r for r in result["runs"]
           if r["model"] == model and r["world_size"] == 4 and r["link_gbit"] == 1.0}
    e = sel.get(SPEEDUP_SUBJECT)
    if e is None:
        return []
    c = result["profiles"][model]["compute_s"]
    eb = e["bytes_per_rank_per_step"]
    table = eb.get("table_gather", 0.0) + eb.get("table_grad", 0.0)
    others = ", ".join(f"{s} {r['bytes_total_per_rank_per_step'] / 1e6:.1f} MB in {r['median_step_s']:.3f} s"
                       for s, r in sel.items() if s != SPEEDUP_SUBJECT)
    return [f"  - why: (e) sends {e['bytes_total_per_rank_per_step'] / 1e6:.1f} MB per rank per step in "
            f"{e['median_step_s']:.3f} s ({others})"
            + (f"; {table / 1e6:.1f} MB of it is the tied output projection's full-table all-gather and "
               "reduce-scatter, the volume of the table's all-reduce" if table else "")
            + f". Compute: forward+backward {c['forward'] + c['backward']:.3f} s and a full-table optimizer "
            f"step {c['optimizer']:.3f} s in one process alone; 4 ranks share "
            f"{meta['machine']['cpus']} cores, so compute takes about {4 / max(1, meta['machine']['cpus'] or 1):.0f}x "
            "longer in the run and the communication left to save is a smaller part of the step."]


def _of(result: Dict[str, Any]) -> str:
    """What the result's ratios divide, in words (:data:`.stats.STATISTIC_WORDS`)."""
    return STATISTIC_WORDS[ratio_statistic(result.get("meta") or {})]


def _method(result: Dict[str, Any]) -> str:
    """How the result's intervals were computed, in words (:func:`.stats.interval_method`)."""
    return interval_method(result.get("meta") or {})


def _layouts(result: Dict[str, Any]) -> List[str]:
    """Strided against contiguous shards, per run: step ratio with its interval, and balance."""
    checks = result.get("layouts") or {}
    if not checks:
        return []
    conf = 100 * result.get("confidence", 0.95)
    L = ["## Shard layouts: strided (default) against contiguous", "",
         f"Ratio = (e') contiguous step / (e) strided step ({_of(result)}), {conf:.0f} % interval ({_method(result)}); "
         "owner side max/mean = the busiest rank's bytes over the mean rank's (rows sent in forward, gradient rows "
         "received in backward). Goal: strided no slower at any rank count (interval's lower end at least "
         f"{1 - NO_WORSE_MARGIN:.2f}: at most {100 * NO_WORSE_MARGIN:.0f} % slower), faster where the exchange is "
         "visible (lower end above 1.0).", "",
         "| run | contiguous / strided | owner max/mean contiguous (rows, grad_rows) | strided | strided no slower |",
         "|---|---|---|---|---|"]
    for key, c in checks.items():
        iv = c["contiguous_over_strided"]
        bal = c["owner_bytes_max_over_mean"]
        fmt = lambda b: ", ".join(f"{b[ph]:.2f}" for ph in ("rows", "grad_rows") if ph in b) or "-"  # noqa: E731
        L.append(f"| {key} | {iv['ratio']:.3f}{_interval(iv)} | {fmt(bal.get('embrace_contiguous', {}))} | "
                 f"{fmt(bal.get(SPEEDUP_SUBJECT, {}))} | {verdict(iv)} |")
    L.append("")
    return L


def _ablation(result: Dict[str, Any]) -> List[str]:
    """The schedule's parts, each against FIFO overlap with backward."""
    table = result.get("schedule_ablation") or {}
    if not table:
        return []
    conf = 100 * result.get("confidence", 0.95)
    L = ["## The 2D schedule, part by part", "",
         f"FIFO / variant = FIFO overlap's step over the variant's ({_of(result)}), {conf:.0f} % interval ({_method(result)}) "
         "(above 1: the variant is faster); hidden = share of communication time overlapped by compute; "
         "over floor = median step / the compute-only floor's.", "",
         "| run | variant | median step s | FIFO / variant | hidden | over floor |", "|---|---|---|---|---|---|"]
    for key, rows in table.items():
        for row in rows:
            label = get_strategy(row["strategy"]).label
            iv = row["fifo_over_variant"]
            hid = "-" if row["hidden_share"] is None else f"{100 * row['hidden_share']:.0f}%"
            flo = "-" if row["over_floor"] is None else f"{row['over_floor']:.2f}"
            L.append(f"| {key} | {label} | {row['median_step_s']:.3f} | {iv['ratio']:.2f}x{_interval(iv)} | "
                     f"{hid} | {flo} |")
    L.append("")
    return L


def attainable_section(limits: Dict[str, Any], conf: float = 95.0) -> List[str]:
    """The schedule's step goals against what the cores allow (:mod:`.attainable`), one
    row per run key of ``limits`` (``result["attainable"]``, or several results')."""
    if not limits:
        return []
    L = ["## What the cores allow", "",
         "CPU bound = the least CPU seconds per step (all ranks, all threads) any ablation variant took for the same "
         "work, over the cores; efficiency = mean step / own CPU bound. "
         f"Floor = the compute-only floor's efficiency ({conf:.0f} % interval): how close to its bound a step comes "
         "with no communication at all. Need = the goal's step target over the CPU bound: below 1 impossible; below "
         "the floor's lower end, beyond the floor (the cores kept busier than with no communication at all). As "
         "judged: the point ratio must clear 1.15 by its interval's reach below the point (the narrowest of the "
         "run's variants).", "",
         "| run | cores | CPU bound s | floor | best variant | >= 1.15x over FIFO: target s, need | "
         "as judged (interval's lower end >= 1.15): target s, need | <= 1.15x the floor: target s, need |",
         "|---|---|---|---|---|---|---|---|"]
    for key, lim in limits.items():
        fe, best = lim["floor_efficiency"], lim["best_efficiency"]
        goals = [f"{g['target_s']:.3f}, {g['need']:.2f}: {g['verdict']}"
                 for g in (lim["goals"][k] for k in ("over_fifo", "over_fifo_as_judged", "over_floor"))]
        L.append(f"| {key} | {lim['cores']} | {lim['bound_s']:.3f} ({get_strategy(lim['bound_from']).short}) | "
                 f"{fe['ratio']:.2f}{_interval(fe)} | {best['ratio']:.2f} ({get_strategy(best['strategy']).short}) | "
                 + " | ".join(goals) + " |")
    L.append("")
    return L


def _nodes(result: Dict[str, Any]) -> List[str]:
    """Several ranks per node: what crosses between nodes, per strategy, and the node-aware
    exchange against the flat one."""
    runs = [r for r in result["runs"] if r.get("ranks_per_node", 1) > 1]
    if not runs:
        return []
    k = runs[0]["ranks_per_node"]
    conf = 100 * result.get("confidence", 0.95)
    L = [f"## Between nodes ({k} ranks per node)", "",
         "Per node and step: the bytes EmbRace's ledger counted as leaving the node, by kind (what the collectives "
         "send; the stock paths' collectives do not say which bytes leave a node), and the node's NIC transmit "
         "counter (tx_bytes of the node's veth, headers included: every strategy).", "",
         "| run | strategy | inter-node MB counted (by kind) | NIC MB | median step s |", "|---|---|---|---|---|"]
    order = lambda r: STRATEGIES.index(r["strategy"])  # noqa: E731
    for r in sorted(runs, key=lambda r: (run_key(r["model"], r["world_size"], record_link(r)), order(r))):
        key = run_key(r["model"], r["world_size"], record_link(r))
        inter = r.get("inter_node_bytes_per_node_per_step")
        counted = "-" if inter is None else (f"{sum(inter.values()) / 1e6:.2f} (" + ", ".join(
            f"{kk} {v / 1e6:.2f}" for kk, v in sorted(inter.items(), key=lambda kv: -kv[1]) if v >= 1e3) + ")")
        L.append(f"| {key} | {get_strategy(r['strategy']).label} | {counted} | "
                 f"{_mb(r.get('wire_bytes_per_node_per_step'))} | {r['median_step_s']:.3f} |")
    L.append("")
    for key, c in (result.get("nodes") or {}).items():
        iv = c["flat_over_node_step"]
        ratio = c["bytes_node_over_flat"]
        L.append(f"- {key}: the exchange's inter-node bytes per node and step, node-aware "
                 f"{c['node_exchange_inter_node_bytes'] / 1e6:.3f} MB / flat {c['flat_exchange_inter_node_bytes'] / 1e6:.3f} MB = "
                 + ("-" if ratio is None else f"{ratio:.2f}")
                 + f" (goal at most 0.7: {'met' if c['bytes_met'] else 'MISSED'}); flat step / node-aware step "
                 f"{iv['ratio']:.2f}x{_interval(iv)} ({conf:.0f} % interval, {_method(result)}"
                 + ("" if "step_met" not in c else
                    f"; goal on this model: lower end at least 1.1: {'met' if c['step_met'] else 'MISSED'}") + ").")
    for key, c in (result.get("two_level") or {}).items():
        iv = c["ring_over_two_level_step"]
        L.append(f"- {key}: the dense all-reduce's inter-node bytes per node and step, two levels "
                 f"{c['two_level_dense_inter_node_bytes'] / 1e6:.2f} MB / one ring "
                 f"{c['ring_dense_inter_node_bytes'] / 1e6:.2f} MB; one-ring step / two-level step "
                 f"{iv['ratio']:.2f}x{_interval(iv)} ({conf:.0f} % interval, {_method(result)}).")
    L.append("")
    return L


def _latency(c: Dict[str, Any]) -> str:
    value = f"{1e3 * c['latency_ms']:.3g} µs"
    if c.get("latency_applied"):
        return value
    return f"{value}, not applied ({'loopback' if c.get('link_applied') is False else 'no sch_netem'})"


def _link(c: Dict[str, Any]) -> str:
    return f"{c['gbit']:.3g}" + (" (not applied: loopback)" if c.get("link_applied") is False else "")


def _value(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:.3g}"


def regimes_section(result: Dict[str, Any]) -> List[str]:
    """Per workload and regime: the real model, the calibration, the limit and every
    strategy's step over it."""
    regimes = result.get("regimes") or {}
    shapes = result.get("workload_shapes") or {}
    if not regimes and not shapes:
        return []
    conf = 100 * result.get("confidence", 0.95)
    L = ["## Compute-matched regimes", ""]
    if regimes:
        L += ["Each regime fixes c10d's communication over the compute-only step of the real model the workload "
              "stands for (the simulator: its gradients all-reduced by ring in fp16, the regime's latency per "
              "message step, over forward + backward + optimizer at the regime's rates). The link is set so that "
              "the bench's c10d bytes (fp32, `perf.bounds`) take that share of the floor measured at the start of "
              "the launch; scale = measured floor / real floor, the latency scaled alike. The limit = max(floor, "
              "least minimum bytes of the run's strategies / link), per timed step of the floor (the mean shown).",
              "", "| run | real model | c10d / floor (real) | floor s (measured) | scale | link Gbit/s | latency | "
              "limit s | bound by |", "|---|---|---|---|---|---|---|---|---|"]
        for key, c in regimes.items():
            lim = c.get("limit") or {}
            L.append(f"| {key}{drift_flag(c)} | {c['real_model']} | {c['ratio']:.3f} | {c['floor_s']:.3f} | {c['scale']:.1f} | "
                     f"{_link(c)} | {_latency(c)} | "
                     + (f"{lim['limit_s']:.3f} | {lim['bound_by']} ({_mb(lim['min_bytes'])} MB of "
                        f"{get_strategy(lim['min_bytes_of']).short} in {lim['min_bytes_over_link_s']:.3f} s) |"
                        if lim else "- | - |"))
        L += ["", f"Step over the limit ({_of(result)}; {conf:.0f} % interval ({_method(result)})):", "",
              "| run | strategy | step / limit |", "|---|---|---|"]
        for key, c in regimes.items():
            over = (c.get("limit") or {}).get("over_limit") or {}
            for s in sorted(over, key=STRATEGIES.index):
                L.append(f"| {key}{drift_flag(c)} | {get_strategy(s).label} | {over[s]['ratio']:.2f}{_interval(over[s])} |")
        L.append("")
        L += dependency_limit_table(regimes)
        for real in dict.fromkeys((c["real_model"], c.get("real_model_description", "")) for c in regimes.values()):
            L.append(f"- {real[0]}: {real[1]}")
        L.append("")
    return L + shapes_table(shapes)


def dependency_limit_table(regimes: Dict[str, Any]) -> List[str]:
    """The dependency-aware limit per run (where the profile timed the output stretch) and
    each EmbRace strategy's step over it."""
    deps = {k: c["dependency_limit"] for k, c in regimes.items() if c.get("dependency_limit")}
    if not deps:
        return []
    L = ["Dependency-aware limit: max(limit, output stretch + dense bytes / link). The output stretch "
         "(`perf/bench/stretch.py`: the output layer's forward, the loss and its input gradient, timed on the "
         "stock model as a share of its step and applied to each floor step) is when no dense gradient can "
         "be on the link, whatever the order.", "",
         "| run | stretch s (share) | dense MB / link s | limit s | strategy | step / limit |",
         "|---|---|---|---|---|---|"]
    for key, d in deps.items():
        for s in sorted(d["over_limit"], key=STRATEGIES.index):
            if not get_strategy(s).shards_table:
                continue
            o = d["over_limit"][s]
            L.append(f"| {key}{drift_flag(regimes[key])} | {d['stretch_s']:.3f} ({100 * d['stretch_share']:.0f} %) | "
                     f"{_mb(d['dense_bytes'])} / {d['dense_over_link_s']:.3f} | {d['limit_s']:.3f} | "
                     f"{get_strategy(s).label} | {o['ratio']:.2f}{_interval(o)} |")
    return L + [""]


def shapes_table(shapes: Dict[str, Any]) -> List[str]:
    """The workloads against the released models they are named after (vocabulary,
    embedding share, tokens per rank), the synthetic ones apart below with why."""
    if not shapes:
        return []
    named = {m: s for m, s in shapes.items() if s.get("real_model")}
    other = {m: s for m, s in shapes.items() if not s.get("real_model")}
    L = ["Workload shapes (embedding share: token table over all parameters, a tied table once):", ""]
    if named:
        L += ["| workload | real model | vocabulary (real = bench) | embedding share real / bench | "
              "tokens per rank (published) | note |", "|---|---|---|---|---|---|"]
        for m, s in named.items():
            share = (f"{100 * s['real_embedding_share']:.1f} % / {100 * s['embedding_share']:.1f} %"
                     if s.get("embedding_share") is not None else "-")
            L.append(f"| {m} | {s['real_model']} | {_value(s.get('vocab'))} | {share} | {_value(s['tokens_per_rank'])}"
                     f" ({_value(s.get('real_tokens_per_gpu'))}) | {s.get('tokens_note') or '-'} |")
        L.append("")
    for m, s in other.items():
        if s.get("synthetic"):
            L.append(f"- {m} (synthetic, no goal): {s.get('synthetic_reason') or 'stands for no released model'}")
        else:  # older results: the fields they hold
            L.append(f"- {m}: " + ", ".join(f"{k} {_value(v)}" for k, v in s.items() if k != "name" and v is not None))
    return L + ([""] if other else [])


def _goal(result: Dict[str, Any]) -> List[str]:
    L = ["## Goal (4 ranks, 1 Gbit/s)", ""]
    if not result["goal"]:
        L.append("No 4-rank 1 Gbit/s run in this report.")
    for model, g in result["goal"].items():
        L += [_goal_line(model, k, v) for k, v in g.items()]
        L += _why(result, model)
    L.append("")
    return L


def _pct(x: Optional[float], signed: bool = False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %")


def _error_row(model: str, link: str, s: Dict[str, Any]) -> str:
    return (f"| {model} | {link} | {s['count']} | {_pct(s['mean_signed_rel_error'], True)} | "
            f"{_pct(s['mean_abs_rel_error'])} | {_pct(s['max_abs_rel_error'])} |")


def simulator_section(result: Dict[str, Any]) -> List[str]:
    """The simulator fitted on one model and link, its errors on every other run."""
    sim = result.get("simulator")
    if not sim:
        return []
    L = ["## Simulator, out of sample", ""]
    if sim.get("error") or sim.get("skipped"):
        L += [f"Not computed: {sim.get('error') or sim['skipped']}.", ""]
        return L
    f, k = sim["fitted_on"], sim["knobs"]
    at = f"in {f['regime']}" if f.get("regime") else f"at {f['link_gbit']:g} Gbit/s"
    where = (f"**{f['model']}** {at}"
             + (f", {f['world_size']} ranks" if "world_size" in f else "") + f" ({f['runs']} runs)")
    L += [f"Network knobs fitted on {where} only: efficiency {k['efficiency']:.2f}, overhead "
          f"{1e3 * k['overhead_s']:.2f} ms per collective, host {1e9 * k['host_s_per_byte']:.0f} ns per byte, "
          f"ranks sharing a core {k.get('shared_core_slowdown', 1.0):.1f}x slower "
          f"(in-sample mean |error| {_pct(sim['in_sample']['mean_abs_rel_error'])}). Compute comes from each "
          "model's own measured profile; every other run is predicted with those knobs. Error = (predicted - "
          "measured) / measured: negative where the simulator is too fast.", "",
          "| model | link | runs | mean error | mean abs error | max abs error |", "|---|---|---|---|---|---|"]
    for model, s in sim["by_model"].items():
        links = [x for x in sim["by_model_link"] if x["model"] == model]
        L += [_error_row(model, x.get("regime") or f"{x['link_gbit']:g} Gbit/s", x) for x in links]
        if len(links) > 1:
            L.append(_error_row(model, "all", s))
    h = sim["held_out"]
    L += ["", f"Held out: mean abs error {_pct(h['mean_abs_rel_error'])} over {h['count']} runs (mean "
          f"{_pct(h['mean_signed_rel_error'], True)}); target at most "
          f"{100 * sim['target_mean_abs_rel_error']:.0f} %"
          + (" per workload" if sim.get("target_per") == "model" else "")
          + f": {'met' if sim.get('within_target', sim['within_20pct']) else 'MISSED'}.", ""]
    return L


def _strategies(result: Dict[str, Any]) -> List[str]:
    """What each strategy of the run is and how it is set up (the baselines as their users
    tune them), from the registry and the builders' settings."""
    from embrace_fairseq.perf.bench.builders import baseline_settings  # torch: only when a report is written

    names = list(dict.fromkeys(r["strategy"] for r in result["runs"]))
    settings = baseline_settings()
    L = ["## Strategies and their settings", "", "| strategy | what | settings |", "|---|---|---|"]
    for n in names:
        spec = get_strategy(n)
        L.append(f"| {spec.label} | {spec.description} | {settings.get(n, '-')} |")
    return L + [""]


def _bucket_cells(st: Dict[str, Any]) -> str:
    """One strategy's bucket settings as the run built it."""
    if "bucket_cap_mb" in st:
        return f"DDP buckets {st['bucket_cap_mb']:.3g} MB, first {st['first_bucket_cap_mb']:.3g} MB"
    if (st.get("embrace") or {}).get("bucket_bytes"):
        e = st["embrace"]
        return f"buckets {e['bucket_bytes'] / 2**20:.3g} MB, pieces {e['piece_bytes'] / 2**20:.3g} MB"
    z = st.get("zero_optimization") or {}
    if z.get("stage"):
        return (f"ZeRO-{z['stage']} reduce {z['reduce_bucket_size']:,} / all-gather {z['allgather_bucket_size']:,} "
                f"elements, use_multi_rank_bucket_allreduce {z.get('use_multi_rank_bucket_allreduce')}")
    return "-"


def _buckets(result: Dict[str, Any]) -> List[str]:
    """Per workload and strategy: the buckets it was built with (its experts' settings
    scaled with the model), the collectives it issued per step and its measured hidden share."""
    rows = [r for r in result["runs"] if r.get("settings")]
    if not rows:
        return []
    L = ["## Buckets scaled with the model", "",
         "Every bucket size is its experts' setting (fairseq's DDP 25 MB with torch's 1 MiB first bucket, "
         "DeepSpeed ZeRO's 5e8 elements, EmbRace's 4 MB buckets and 1 MB pieces) times the workload's scale: the "
         "bench's gradient bytes (fp32) over the real model's (fp16), so that the bench model has as many buckets "
         "as the real one; a synthetic workload keeps the settings as they are. Hidden: the share of the "
         "strategy's communication time that overlapped its compute, from the same trace for every strategy.", "",
         "| run | strategy | scale | settings | collectives / step | hidden |", "|---|---|---|---|---|---|"]
    for r in rows:
        st = r["settings"]
        calls = ", ".join(f"{k} {v:.3g}" for k, v in (r.get("collectives_per_step_by_op") or {}).items()) or "-"
        hid = "-" if r.get("hidden_share") is None else f"{100 * r['hidden_share']:.0f}%"
        scale = st.get("bucket_scale")
        L.append(f"| {run_key(r['model'], r['world_size'], record_link(r))} | {get_strategy(r['strategy']).short} | "
                 f"{'-' if scale is None else f'{scale:.3g}'} | {_bucket_cells(st)} | {calls} | {hid} |")
    return L + [""]


def markdown(result: Dict[str, Any], plot_names: List[str]) -> str:
    L = _setup(result["meta"]) + _strategies(result) + _buckets(result) + _profiles(result) + _run_tables(result) + _layouts(result)
    L += _ablation(result) + attainable_section(result.get("attainable") or {}, 100 * result.get("confidence", 0.95))
    L += _nodes(result) + regimes_section(result) + simulator_section(result)
    # a regime run is judged by the regime goals; the 1 Gbit/s goal section is for fixed links
    L += goals_markdown(result["regime_goals"]) if result.get("regime_goals") else _goal(result)
    L.append(f"Ratios are (other strategy's step) / ((e)'s step), each the {_of(result)}. 'loss drift' = largest relative "
             "difference of the per-step loss from legacy_ddp's (without it in the run: the first strategy other than the floor's) on the same batches (all strategies are the same "
             "synchronous SGD). Bytes: what one rank sends per step under ring/direct algorithms, from EmbRace's "
             "ledger for (d)/(e) and from the collectives the stock paths issue; 'wire' = tx_bytes of the rank's "
             "veth (headers included).")
    L.append("")
    for name in plot_names:
        L.append(f"![{name}]({name})")
    L.append("")
    return "\n".join(L)
