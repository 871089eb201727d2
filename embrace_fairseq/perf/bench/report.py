"""From the ranks' raw records to ``bench.json``, ``report.md`` and the plots.

Per run (model, ranks, link, strategy): the step time of a step is the slowest rank's
(every step ends in a collective, so ranks finish together); the median is over the
timed steps; tokens/s is all ranks' target tokens over the summed step times; bytes
by kind are averaged over ranks and steps. The analytic minimum comes from
:func:`embrace_fairseq.perf.bounds.min_bytes_per_step` when that module is present
(``"bounds": "unavailable"`` otherwise), averaged over the same batches.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from embrace_fairseq.perf.bench import STRATEGIES

LABELS = {
    "fairseq_legacy_ddp": "(a) fairseq legacy_ddp",
    "fairseq_c10d": "(a') fairseq c10d (torch DDP)",
    "deepspeed": "(b) DeepSpeed stock",
    "sparse_allgather": "(c) sparse all-gather (DeepSpeed)",
    "embrace_noschedule": "(d) EmbRace, no schedule",
    "embrace_schedule": "(e) EmbRace, 2D schedule",
}
# Goal (4 ranks, 1 Gbit/s): speedup of (e) over each strategy, per model
GOALS = {
    "lm": {"fairseq_legacy_ddp": 2.0, "fairseq_c10d": 2.0, "deepspeed": 2.0, "sparse_allgather": 1.2},
    "translation": {"fairseq_legacy_ddp": 1.3, "fairseq_c10d": 1.3, "deepspeed": 1.3, "sparse_allgather": 1.2},
}
BYTES_GOAL = 1.10
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


def _bounds_fn():
    try:
        from embrace_fairseq.perf.bounds import min_bytes_per_step  # type: ignore
    except Exception:  # the module is optional
        return None
    return min_bytes_per_step


def link_key(link: Dict[str, float]) -> str:
    return f"{link['gbit']:g}gbit_{link['latency_ms']:g}ms"


def run_key(model: str, world: int, link: Dict[str, float]) -> str:
    return f"{model}/w{world}/{link_key(link)}"


def assemble(meta: Dict[str, Any], raw: List[Dict[str, Any]], batches: Dict[Tuple[str, int], Any],
             quick: bool) -> Dict[str, Any]:
    bounds = _bounds_fn()
    meta = dict(meta, bounds="comm_bounds.min_bytes_per_step" if bounds else "unavailable")
    profiles: Dict[str, Any] = {}
    runs: List[Dict[str, Any]] = []
    consistency: Dict[str, Any] = {}
    for launch in raw:
        model, world, ranks = launch["model"], launch["world_size"], launch["ranks"]
        prof = ranks[0].get("compute_profile", {})
        pm = profiles.setdefault(model, {"vocab": prof["vocab"], "dim": prof["dim"], "dense_numel": prof["dense_numel"],
                                         "dense_layers": prof["dense_layers"], "_compute": [],
                                         "_tokens": [], "unique_ids_per_rank": {}})
        pm["_compute"].append(prof["compute_s"])
        b = batches[(model, world)]
        tied = "--share-all-embeddings" in b.workload.model_args  # the output projection reads the table
        for li, link_rec in enumerate(ranks[0]["links"]):
            link = link_rec["link"]
            names = list(link_rec["strategies"])
            steps = link_rec["strategies"][names[0]]["batch_steps"]
            ids = [[b.ids(s, r) for r in range(world)] for s in steps]
            if li == 0:
                pm["unique_ids_per_rank"][str(world)] = [
                    statistics.fmean(float(ids[i][r].unique().numel()) for i in range(len(steps))) for r in range(world)]
            losses = {}
            for name in names:
                per_rank = [rk["links"][li]["strategies"][name] for rk in ranks]
                n_steps = len(per_rank[0]["step_s"])
                step_s = [max(pr["step_s"][i] for pr in per_rank) for i in range(n_steps)]
                tokens = sum(pr["tokens"] for pr in per_rank)
                pm["_tokens"].append(tokens / (world * n_steps))
                kinds = sorted({k for pr in per_rank for k in pr["bytes_by_kind"]})
                by_kind = {k: statistics.fmean(pr["bytes_by_kind"].get(k, 0.0) for pr in per_rank) for k in kinds}
                counted = sorted({k for pr in per_rank for k in pr["counted_bytes_by_op"]})
                wire = [pr["wire_bytes_per_step"] for pr in per_rank]
                hidden = [pr.get("hidden_share") for pr in per_rank if pr.get("hidden_share") is not None]
                min_b = None
                if bounds is not None:
                    try:
                        totals = [bounds(name, world_size=world, vocab=prof["vocab"], dim=prof["dim"],
                                         dense_numel=prof["dense_numel"], ids_per_rank=step_ids,
                                         tied_output="gather" if tied else None)["total"]
                                  for step_ids in ids]
                        min_b = statistics.fmean(totals)
                    except Exception as exc:  # a strategy the bounds do not know: say so
                        meta.setdefault("bounds_errors", {})[name] = f"{type(exc).__name__}: {exc}"
                total = sum(by_kind.values())
                runs.append({
                    "model": model, "world_size": world, "link_gbit": link["gbit"], "latency_ms": link["latency_ms"],
                    "strategy": name, "median_step_s": statistics.median(step_s), "step_s": step_s,
                    "tokens_per_s": tokens / sum(step_s),
                    "bytes_per_rank_per_step": by_kind, "bytes_total_per_rank_per_step": total,
                    "collective_bytes_by_op": {k: statistics.fmean(pr["counted_bytes_by_op"].get(k, 0.0)
                                                                   for pr in per_rank) for k in counted},
                    "wire_bytes_per_rank_per_step": None if any(x is None for x in wire) else statistics.fmean(wire),
                    "min_bytes_per_rank_per_step": min_b,
                    "bytes_over_min": (total / min_b) if min_b else None,
                    "hidden_share": statistics.fmean(hidden) if hidden else None,
                    "exchange_balance": exchange_balance(per_rank, n_steps),
                    "trace": per_rank[0].get("trace"),
                    "loss": per_rank[0]["loss"],
                })
                losses[name] = per_rank[0]["loss"]
            ref = losses.get("fairseq_legacy_ddp") or next(iter(losses.values()))
            consistency[run_key(model, world, link)] = {
                n: max(abs(x - y) / max(1e-12, abs(y)) for x, y in zip(l, ref)) for n, l in losses.items()}
    for pm in profiles.values():
        comp = pm.pop("_compute")
        pm["compute_s"] = {k: statistics.median(c[k] for c in comp) for k in ("forward", "backward", "optimizer")}
        pm["tokens_per_rank"] = int(round(statistics.fmean(pm.pop("_tokens"))))
    ratios: Dict[str, Dict[str, float]] = {}
    med = {(r["model"], r["world_size"], r["link_gbit"], r["latency_ms"], r["strategy"]): r["median_step_s"] for r in runs}
    for (m, wsz, g, lat, s), v in med.items():
        e = med.get((m, wsz, g, lat, "embrace_schedule"))
        if e and s != "embrace_schedule":
            ratios.setdefault(run_key(m, wsz, {"gbit": g, "latency_ms": lat}), {})[s] = v / e
    result = {"meta": meta, "profiles": profiles, "runs": runs, "ratios": ratios,
              "loss_max_rel_diff_vs_legacy_ddp": consistency}
    result["goal"] = goal_check(result)
    return result


def goal_check(result: Dict[str, Any]) -> Dict[str, Any]:
    """The targets at 4 ranks, 1 Gbit/s: met or missed, by how much."""
    out: Dict[str, Any] = {}
    runs = result["runs"]
    for model, targets in GOALS.items():
        sel = [r for r in runs if r["model"] == model and r["world_size"] == 4 and r["link_gbit"] == 1.0]
        if not sel:
            continue
        by = {r["strategy"]: r for r in sel}
        e = by.get("embrace_schedule")
        if e is None:
            continue
        g: Dict[str, Any] = {}
        for s, target in targets.items():
            if s in by:
                ratio = by[s]["median_step_s"] / e["median_step_s"]
                g[f"speedup_over_{s}"] = {"target": target, "measured": ratio, "met": ratio >= target,
                                          "shortfall": max(0.0, target - ratio)}
        if "embrace_noschedule" in by:
            ratio = by["embrace_noschedule"]["median_step_s"] / e["median_step_s"]
            g["schedule_vs_noschedule"] = {"target": ">1", "measured": ratio, "met": ratio > 1.0,
                                           "hidden_share": e["hidden_share"],
                                           "hidden_share_noschedule": by["embrace_noschedule"]["hidden_share"]}
        if e.get("bytes_over_min") is not None:
            g["bytes_over_min"] = {"target": BYTES_GOAL, "measured": e["bytes_over_min"],
                                   "met": e["bytes_over_min"] <= BYTES_GOAL}
        else:
            g["bytes_over_min"] = {"target": BYTES_GOAL, "measured": None, "met": None,
                                   "note": "bounds unavailable"}
        out[model] = g
    return out


# ---------------------------------------------------------------------- outputs


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def write_outputs(result: Dict[str, Any], out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths += plots(result, out)
    md = out / "report.md"
    md.write_text(markdown(result, [p.name for p in paths if p.suffix == ".png"]))
    paths.append(md)
    return paths


def markdown(result: Dict[str, Any], plot_names: List[str]) -> str:
    meta = result["meta"]
    L: List[str] = [f"# EmbRace benchmark ({meta['mode']} mode)", ""]
    L.append(f"Command: `{meta['command']}`; wall {meta['wall_s'] or 0:.0f} s; versions "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".")
    L.append("")
    if meta["fallback_loopback"]:
        L.append(f"**FALLBACK: loopback, no emulated links** ({meta['fallback_reason']}). Communication is "
                 "nearly free here; these figures do not show link-bound behaviour.")
    else:
        L.append(f"Emulated cluster: one network namespace per rank, veth to a bridge in a switch namespace, "
                 f"each rank's link shaped in both directions ({meta['link']['shaping']}); rates "
                 f"{', '.join(f'{g:g}' for g in meta['link']['gbit'])} Gbit/s"
                 + ("" if meta["latency_applied"] else
                    f"; the {meta['link']['latency_ms']:g} ms latency was NOT applied (this kernel has no sch_netem)")
                 + ".")
    cpus = meta["machine"]["cpus"]
    L.append(f"Machine: {cpus} CPU cores, 1 torch thread per rank, load at start "
             f"{', '.join(f'{x:.2f}' for x in meta['machine']['load_at_start'])}. "
             + ("4 ranks oversubscribe the cores: compute is slower than on 4 real nodes." if cpus and cpus < 4 else ""))
    s = meta["schedule"]
    L.append(f"Steps: {s['warmup']} warm-up, then {s['rounds']} rounds x {s['steps_per_round']} timed steps per strategy, "
             f"interleaved ({s['interleaving']}); step time = slowest rank's, after a barrier. "
             f"Bounds: {meta['bounds']}.")
    L.append("")
    for model, p in result["profiles"].items():
        c = p["compute_s"]
        L.append(f"**{model}**: vocab {p['vocab']:,}, dim {p['dim']}, table {p['vocab'] * p['dim']:,} params, "
                 f"dense {p['dense_numel']:,} params, {p['tokens_per_rank']} target tokens per rank per step; "
                 f"single-process compute forward {c['forward']:.3f} s, backward {c['backward']:.3f} s, "
                 f"optimizer {c['optimizer']:.3f} s; unique ids per rank: "
                 + "; ".join(f"{w} ranks {statistics.fmean(v):.0f}" for w, v in p["unique_ids_per_rank"].items()) + ".")
    L.append("")
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in result["runs"]:
        groups.setdefault(run_key(r["model"], r["world_size"], {"gbit": r["link_gbit"], "latency_ms": r["latency_ms"]}),
                          []).append(r)
    for key, rs in groups.items():
        L.append(f"## {key}")
        L.append("")
        L.append("| strategy | median step s | tokens/s | MB sent/rank/step (by kind) | wire MB | bytes/min | hidden | (e) speedup | loss drift |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        ratios = result["ratios"].get(key, {})
        drift = result["loss_max_rel_diff_vs_legacy_ddp"].get(key, {})
        for r in sorted(rs, key=lambda r: STRATEGIES.index(r["strategy"])):
            kinds = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(r["bytes_per_rank_per_step"].items(),
                                                                       key=lambda kv: -kv[1]) if v >= 1e3)
            over = "-" if r["bytes_over_min"] is None else f"{r['bytes_over_min']:.2f}"
            hid = "-" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.0f}%"
            sp = "-" if r["strategy"] == "embrace_schedule" else f"{ratios.get(r['strategy'], float('nan')):.2f}x"
            L.append(f"| {LABELS[r['strategy']]} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{_mb(r['bytes_total_per_rank_per_step'])} ({kinds or '-'}) | "
                     f"{_mb(r['wire_bytes_per_rank_per_step'])} | {over} | {hid} | {sp} | "
                     f"{drift.get(r['strategy'], 0.0):.1e} |")
        L.append("")
        bal = [r for r in sorted(rs, key=lambda r: STRATEGIES.index(r["strategy"])) if r.get("exchange_balance")]
        if bal:
            L.append("Exchange balance (busiest rank vs mean, per step; owner side: rows sent in forward, "
                     "gradient rows received in backward):")
            L.append("")
            L.append("| strategy | phase | KB max | KB mean | max/mean | link max/mean | AlltoAll ms max | ms mean | max/mean |")
            L.append("|---|---|---|---|---|---|---|---|---|")
            for r in bal:
                for phase, b in r["exchange_balance"].items():
                    t = (f"{1e3 * b['alltoall_s_max']:.2f} | {1e3 * b['alltoall_s_mean']:.2f} | "
                         f"{b['alltoall_s_max_over_mean']:.2f}") if b.get("alltoall_s_max") is not None else "- | - | -"
                    L.append(f"| {LABELS[r['strategy']]} | {phase} | {b['bytes_max'] / 1e3:.1f} | "
                             f"{b['bytes_mean'] / 1e3:.1f} | {b['bytes_max_over_mean']:.2f} | "
                             f"{b['link_max_over_mean']:.2f} | {t} |")
            L.append("")
    L.append("## Goal (4 ranks, 1 Gbit/s)")
    L.append("")
    if not result["goal"]:
        L.append("No 4-rank 1 Gbit/s run in this report.")
    for model, g in result["goal"].items():
        for k, v in g.items():
            m = v.get("measured")
            state = "met" if v.get("met") else ("n/a" if v.get("met") is None else "MISSED")
            extra = ""
            if k.startswith("speedup") and not v["met"]:
                extra = f" (short by {v['shortfall']:.2f}x)"
            if k == "schedule_vs_noschedule":
                hs = v.get("hidden_share")
                extra = f"; hidden share of communication {'-' if hs is None else f'{100 * hs:.0f}%'} with the schedule"
            L.append(f"- {model}, {k}: target {v['target']}, measured "
                     f"{'-' if m is None else f'{m:.2f}'} -> {state}{extra}")
        sel = {r["strategy"]: r for r in result["runs"]
               if r["model"] == model and r["world_size"] == 4 and r["link_gbit"] == 1.0}
        e = sel.get("embrace_schedule")
        if e is not None:
            c = result["profiles"][model]["compute_s"]
            eb = e["bytes_per_rank_per_step"]
            table = eb.get("table_gather", 0.0) + eb.get("table_grad", 0.0)
            others = ", ".join(f"{s} {r['bytes_total_per_rank_per_step'] / 1e6:.1f} MB in {r['median_step_s']:.3f} s"
                               for s, r in sel.items() if s != "embrace_schedule")
            L.append(f"  - why: (e) sends {e['bytes_total_per_rank_per_step'] / 1e6:.1f} MB per rank per step in "
                     f"{e['median_step_s']:.3f} s ({others})"
                     + (f"; {table / 1e6:.1f} MB of it is the tied output projection's full-table all-gather and "
                        "reduce-scatter, the volume of the table's all-reduce" if table else "")
                     + f". Compute: forward+backward {c['forward'] + c['backward']:.3f} s and a full-table optimizer "
                     f"step {c['optimizer']:.3f} s in one process alone; 4 ranks share "
                     f"{meta['machine']['cpus']} cores, so compute takes about {4 / max(1, meta['machine']['cpus'] or 1):.0f}x "
                     "longer in the run and the communication left to save is a smaller part of the step.")
    L.append("")
    L.append("Ratios are (other strategy's median step) / ((e)'s median step). 'loss drift' = largest relative "
             "difference of the per-step loss from legacy_ddp's on the same batches (all strategies are the same "
             "synchronous SGD). Bytes: what one rank sends per step under ring/direct algorithms, from EmbRace's "
             "ledger for (d)/(e) and from the collectives the stock paths issue; 'wire' = tx_bytes of the rank's "
             "veth (headers included).")
    L.append("")
    for name in plot_names:
        L.append(f"![{name}]({name})")
    L.append("")
    return "\n".join(L)


def plots(result: Dict[str, Any], out: Path) -> List[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths: List[Path] = []
    runs = result["runs"]
    models = list(result["profiles"])
    # throughput against ranks
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, s in enumerate(STRATEGIES):
            for g, style in ((1.0, "-o"), (10.0, "--s")):
                pts = sorted((r["world_size"], r["tokens_per_s"]) for r in runs
                             if r["model"] == model and r["strategy"] == s and r["link_gbit"] == g)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, color=f"C{i}", label=f"{LABELS[s]} {g:g} Gbit/s")
        ax.set_xticks(sorted({r["world_size"] for r in runs}))
        ax.set_title(f"{model}: throughput")
        ax.set_xlabel("ranks")
        ax.set_ylabel("tokens / s (all ranks)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    p = out / "throughput_vs_ranks.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    # bytes by kind, largest world at 1 Gbit/s
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        sel = [r for r in runs if r["model"] == model and r["link_gbit"] == min(r2["link_gbit"] for r2 in runs)]
        if not sel:
            continue
        wmax = max(r["world_size"] for r in sel)
        sel = sorted([r for r in sel if r["world_size"] == wmax], key=lambda r: STRATEGIES.index(r["strategy"]))
        kinds = sorted({k for r in sel for k in r["bytes_per_rank_per_step"]})
        bottom = [0.0] * len(sel)
        for j, k in enumerate(kinds):
            vals = [r["bytes_per_rank_per_step"].get(k, 0.0) / 1e6 for r in sel]
            ax.bar(range(len(sel)), vals, bottom=bottom, label=k, color=f"C{j}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        mins = [r["min_bytes_per_rank_per_step"] for r in sel]
        if any(m is not None for m in mins):
            ax.scatter([i for i, m in enumerate(mins) if m is not None],
                       [m / 1e6 for m in mins if m is not None], marker="_", s=400, color="k", label="analytic minimum")
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([s["strategy"].replace("_", "\n") for s in sel], fontsize=7)
        ax.set_ylabel("MB sent per rank per step")
        ax.set_title(f"{model}: bytes by kind ({wmax} ranks)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "bytes_by_kind.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    # timeline excerpt from an EmbRace trace (rank 0)
    cand = [r for r in runs if r["strategy"] == "embrace_schedule" and r.get("trace")]
    if cand:
        r = max(cand, key=lambda r: (r["model"] == "lm", r["world_size"], -r["link_gbit"]))
        tp = out / r["trace"]
        if tp.exists():
            p = _timeline(plt, tp, out / "timeline_excerpt.png",
                          f"{r['model']}, {r['world_size']} ranks, {r['link_gbit']:g} Gbit/s, (e) rank 0")
            if p:
                paths.append(p)
    return paths


def _timeline(plt, trace_path: Path, path: Path, title: str) -> Optional[Path]:
    evs = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    fwd = sorted(e["ts"] for e in evs if e["name"] == "forward")
    if len(fwd) < 3:
        return None
    t0, t1 = fwd[-3], fwd[-1]  # two steps
    rows = {0: "compute", 2: "embedding exchange", 3: "tied table", 1: "dense all-reduce"}
    fig, ax = plt.subplots(figsize=(11, 3))
    colors = {"forward": "C0", "backward": "C1", "step": "C2"}
    for e in evs:
        if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        y = {0: 3, 2: 2, 3: 1, 1: 0}[e["tid"]]
        c = colors.get(e["name"], {1: "C3", 3: "C5"}.get(e["tid"], "C4"))
        ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.35, 0.7), color=c, edgecolor="k", lw=0.2)
    ax.set_yticks([3, 2, 1, 0])
    ax.set_yticklabels([rows[0], rows[2], rows[3], rows[1]])
    ax.set_xlabel("ms (two steps)")
    ax.set_title(title + "  (compute: forward C0, backward C1, optimizer C2)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
