"""Plots of a benchmark result: throughput against ranks, bytes by kind, a trace excerpt."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, STRATEGIES, get_strategy


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
                    ax.plot(xs, ys, style, color=f"C{i}", label=f"{get_strategy(s).label} {g:g} Gbit/s")
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
    cand = [r for r in runs if r["strategy"] == SPEEDUP_SUBJECT and r.get("trace")]
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
