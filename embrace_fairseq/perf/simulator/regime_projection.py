"""The released models in the compute-matched regimes at 16-64 GPUs (``regimes`` command).

Each model of :mod:`.real_models` (the ones the benchmark's workloads stand for) on the
GPUs and networks of :mod:`.regimes` (v100-25g, a100-100g): EmbRace with the 2D schedule
as built (:data:`.paper.AS_BUILT`, the tied output read as the automatic rule picks per
world size) against every registered stock strategy and the compute-only floor, through
:func:`.paper.projected`. Two topologies (:data:`.paper.TOPOLOGIES`): *flat*, one NIC of
the regime's rate per GPU (the regime as stated, the benchmark's calibration), and *nodes
of 8*, eight GPUs behind one NIC of eight times the regime's rate (the same bandwidth per
GPU off the node) with NVLink-class links inside. Compute, latency and fp16 wire bytes are
the regime's (stated, not measured: :mod:`.regimes`). No benchmark is read.

``--compute-floor PROFILE`` (a :mod:`embrace_fairseq.perf.gpu_profile` result) keeps each
model's forward + backward at least as long as measured there: a GPU slower than the one
measured, running the same code on the same batch, cannot be faster (:func:`floored`).
Each result then also holds the regime's own figures (``as_stated``), side by side.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from embrace_fairseq.planner.inputs import INPUT, TIED, PlanInputs, Rates, TableInput
from embrace_fairseq.planner.network import Network
from embrace_fairseq.planner.plan import Plan, choose
from embrace_fairseq.perf.simulator.paper import (AS_BUILT, TOPOLOGIES, Topology, _with_output, projected,
                                                  stock_baselines)
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.simulator.real_models import REAL_MODELS, RealModel
from embrace_fairseq.perf.simulator.regimes import C10D, FLOOR, REGIMES, Regime, regime_terms
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, get_strategy

WORLDS = (16, 32, 64)
FIFO = "embrace_fifo"


def floored(profile: Profile, forward_backward_s: Optional[float]) -> Profile:
    """``profile`` with its forward and backward stretched alike so that together they take
    at least ``forward_backward_s`` (None: as it is). The optimizer step is left alone.

    >>> p = Profile("p", vocab=10, dim=2, dense_layers=[("d", 4)], tokens_per_rank=1, forward_s=0.01,
    ...             backward_s=0.02, optimizer_s=0.005)
    >>> q = floored(p, 0.06)
    >>> round(q.forward_s, 6), round(q.backward_s, 6), q.optimizer_s, floored(p, 0.01) is p
    (0.02, 0.04, 0.005, True)
    """
    if forward_backward_s is None or forward_backward_s <= profile.forward_s + profile.backward_s:
        return profile
    k = forward_backward_s / (profile.forward_s + profile.backward_s)
    return replace(profile, forward_s=profile.forward_s * k, backward_s=profile.backward_s * k)


def measured_floors(path: Path) -> Dict[str, float]:
    """Released model -> measured forward + backward seconds of a gpu_profile result."""
    data = json.loads(Path(path).read_text())
    return {m["real_model"]: m["forward_backward_ms"]["median"] / 1e3 for m in data["models"] if not data.get("tiny")}


def regime_network(regime: Regime, topo: Topology) -> Network:
    """The regime's network on ``topo``: its rate and latency per GPU; on nodes, the node's
    NIC carries its GPUs' rates together."""
    return Network(regime.gbit_per_gpu * topo.ranks_per_node, latency_s=regime.latency_s,
                   ranks_per_node=topo.ranks_per_node, intra_gbit=topo.intra_gbit)


def plan_for(prof: Profile, world: int, regime: Regime, topo: Topology) -> Plan:
    """The plan ``--embrace-plan auto`` would choose for this model on this cluster: the
    planner's own cost model (:mod:`embrace_fairseq.planner`) fed what its probe would
    measure there (the regime's rate per GPU and latency, the profile's forward and
    backward as the step's compute)."""
    tied = prof.tied_output is not None
    out_tokens = int(prof.output_tokens_per_rank or prof.tokens_per_rank) if tied else 0
    table = TableInput("embed_tokens", prof.vocab, prof.dim, TIED if tied else INPUT,
                       lookups_per_rank=int(prof.tokens_per_rank), output_tokens_per_rank=out_tokens)
    rates = Rates(regime.gbit_per_gpu * 1e9 / 8, regime.latency_s, prof.forward_s + prof.backward_s)
    rpn = topo.ranks_per_node if world >= topo.ranks_per_node else 1
    return choose(PlanInputs((table,), prof.dense_numel, world, rpn, rates, element_size=prof.element_size,
                             id_size=prof.id_size))


def project(model: RealModel, regime: Regime, world: int, topo: Topology = TOPOLOGIES[0],
            opts: Options = AS_BUILT, compute_floor_s: Optional[float] = None) -> dict:
    """One setting: :func:`.paper.projected`'s steps and speedups, c10d's communication
    seconds (the link's busy time) and its share of the floor's step."""
    prof = floored(model.profile(regime), compute_floor_s)
    net = regime_network(regime, topo)
    row = projected(prof, world, net, opts)
    c10d_comm = predict(prof, C10D, world, net, opts).comm_s
    best = row["best_baseline"]
    # the default plan, priced by the planner, its step the simulator's for what it chose:
    # sharded with the schedule (its sizes) or with whole buckets in readiness order (FIFO)
    plan = plan_for(prof, world, regime, topo)
    steps = row["step_s"]
    auto_s = steps[C10D]
    if plan.sharded:
        chosen = replace(opts, embrace_bucket_bytes=plan.bucket_bytes,
                         embrace_piece_bytes=plan.piece_bytes or plan.bucket_bytes)
        shaped = _with_output(prof, row["output"])
        auto_s = predict(shaped, SPEEDUP_SUBJECT if plan.schedule else FIFO, world, net, chosen).step_s
    fixed = min(steps[SPEEDUP_SUBJECT], steps[C10D], steps.get(FIFO, float("inf")))
    auto = {"spec": plan.spec(), "sharded": plan.sharded, "schedule": plan.schedule,
            "planner_speedup": plan.speedup, "step_s": auto_s, "over_c10d": steps[C10D] / auto_s,
            "over_best_fixed": fixed / auto_s}
    return dict(row, model=model.name, regime=regime.name, topology=topo.name, link_gbit=net.link_gbit,
                c10d_comm_s=c10d_comm, c10d_comm_over_floor=c10d_comm / steps[FLOOR],
                speedup_over_best=row["speedup_of_embrace_schedule"][best], auto=auto)


def regime_study(models: Optional[Dict[str, RealModel]] = None, regimes: Optional[Dict[str, Regime]] = None,
                 worlds: Sequence[int] = WORLDS, topologies: Sequence[Topology] = TOPOLOGIES,
                 compute_floors: Optional[Dict[str, float]] = None) -> dict:
    """Every model, regime, topology and world size, as built; each model's forward +
    backward at least ``compute_floors[name]`` seconds where given."""
    floors = compute_floors or {}
    models = REAL_MODELS if models is None else models
    regimes = REGIMES if regimes is None else regimes
    out = {
        "assumptions": {
            "regimes": {name: r.as_dict() for name, r in regimes.items()},
            "topologies": {t.name: {"ranks_per_node": t.ranks_per_node, "intra_gbit": t.intra_gbit,
                                    "node_nic": "the regime's Gbit/s per GPU times the GPUs of a node"}
                           for t in topologies},
            "embrace": {"shard_layout": AS_BUILT.shard_layout, "bucket_bytes": AS_BUILT.embrace_bucket_bytes,
                        "piece_bytes": AS_BUILT.embrace_piece_bytes, "relaxed_embedding": AS_BUILT.defer_rows,
                        "tied_output": "the automatic rule per world size (vocab-parallel where its bytes are "
                                       "below the table all-gather's)"},
            "baselines": stock_baselines(),
            "compute": "6 training FLOPs per parameter per token plus attention scores and the output layer at the "
                       "regime's sustained FLOP/s; backward 2x forward; Adam 32 bytes per parameter at the "
                       "regime's memory rate (perf/simulator/paper.py, real_models.py)",
        },
        "models": {},
    }
    if floors:
        out["assumptions"]["compute_floor_s"] = dict(floors)
    for name, model in models.items():
        results = []
        for regime in regimes.values():
            prof = floored(model.profile(regime), floors.get(name))
            ratio = {w: regime_terms(prof, regime, w)["ratio"] for w in worlds}
            for topo in topologies:
                for w in worlds:
                    row = dict(project(model, regime, w, topo, compute_floor_s=floors.get(name)),
                               c10d_ratio_flat=ratio[w])
                    if floors:
                        stated = project(model, regime, w, topo)
                        row["as_stated"] = {k: stated[k] for k in ("speedup_over_best", "best_baseline",
                                                                   "c10d_comm_over_floor")}
                    results.append(row)
        out["models"][name] = {"description": model.description, "results": results}
    return out


# ------------------------------------------------------------------ the markdown and the plot


def _select(study: dict, model: str, **want) -> List[dict]:
    return [r for r in study["models"][model]["results"] if all(r[k] == v for k, v in want.items())]


def _short(s: str) -> str:
    return get_strategy(s).short


def _headline(study: dict, topo: str, worlds: Sequence[int]) -> List[str]:
    L = [f"| model | regime | " + " | ".join(f"{w} GPUs" for w in worlds) + " |",
         "|---|---" + "|---" * len(worlds) + "|"]
    for name in study["models"]:
        for regime in study["assumptions"]["regimes"]:
            cells = []
            for w in worlds:
                (r,) = _select(study, name, regime=regime, topology=topo, world_size=w)
                cell = f"{r['speedup_over_best']:.2f}x ({_short(r['best_baseline'])})"
                if "as_stated" in r:
                    cell += f"; stated {r['as_stated']['speedup_over_best']:.2f}x"
                cells.append(cell)
            L.append(f"| {name} | {regime} | " + " | ".join(cells) + " |")
    return L + [""]


def _plans(study: dict, topo: str, worlds: Sequence[int]) -> List[str]:
    """The default plan per model, regime and world size: what the planner chose, and its
    step (the simulator's) over c10d's and over the best fixed plan's."""
    L = ["| model | regime | " + " | ".join(f"{w} GPUs" for w in worlds) + " |",
         "|---|---" + "|---" * len(worlds) + "|"]
    for name in study["models"]:
        for regime in study["assumptions"]["regimes"]:
            cells = []
            for w in worlds:
                (r,) = _select(study, name, regime=regime, topology=topo, world_size=w)
                a = r["auto"]
                cells.append(f"{'shard' if a['sharded'] else 'stock'}: {a['over_c10d']:.2f}x c10d, "
                             f"{a['over_best_fixed']:.2f} of best")
            L.append(f"| {name} | {regime} | " + " | ".join(cells) + " |")
    return L + [""]


def _detail(study: dict, topo: str, world: int) -> List[str]:
    cols = study["assumptions"]["baselines"]
    L = [f"### {topo}, {world} GPUs", "",
         "| model | regime | output | c10d comm / floor | " + " | ".join(_short(s) for s in cols)
         + " | (e) step ms | floor ms | (e) over floor | best baseline over floor |",
         "|---|---|---|---" + "|---" * len(cols) + "|---|---|---|---|"]
    for name in study["models"]:
        for r in _select(study, name, topology=topo, world_size=world):
            sp, fl = r["speedup_of_embrace_schedule"], r["over_floor"]
            L.append(f"| {name} | {r['regime']} | {r['output'] or 'untied'} | {r['c10d_comm_over_floor']:.2f} | "
                     + " | ".join(f"{sp[s]:.2f}x" for s in cols)
                     + f" | {1e3 * r['step_s'][SPEEDUP_SUBJECT]:.1f} | {1e3 * r['step_s'][FLOOR]:.1f} | "
                     f"{fl[SPEEDUP_SUBJECT]:.2f} | {fl[r['best_baseline']]:.2f} ({_short(r['best_baseline'])}) |")
    return L + [""]


def markdown(study: dict) -> str:
    """Assumptions, the headline per topology ((e) over the fastest stock baseline), and a
    table per topology and world size (every baseline, the floor, c10d's share)."""
    a = study["assumptions"]
    worlds = sorted({r["world_size"] for m in study["models"].values() for r in m["results"]})
    regimes = "; ".join(f"**{n}**: {r['sustained_flops'] / 1e12:g} TFLOP/s sustained, "
                        f"{r['memory_bytes_per_s'] / 1e12:g} TB/s for the optimizer, {r['gbit_per_gpu']:g} Gbit/s per "
                        f"GPU, {1e6 * r['latency_s']:g} µs per message step, {r['wire_bytes']}-byte gradients"
                        for n, r in a["regimes"].items())
    src = study.get("source") or {}
    floored_by = " with each model's compute floored by a measured step" if a.get("compute_floor_s") else ""
    span = f"{worlds[0]}-{worlds[-1]}" if len(worlds) > 1 else f"{worlds[0]}"
    L = [f"# EmbRace in the compute-matched regimes, {span} GPUs (simulator){floored_by}", "",
         f"Written by `{study.get('command', 'python -m embrace_fairseq.perf.simulator regimes')}` at commit "
         f"{src.get('commit') or 'unknown'}{' (tree with changes)' if src.get('dirty') else ''}.", "",
         "Assumptions (stated, not measured):", "",
         f"* Regimes: {regimes}.",
         f"* Compute: {a['compute']}.",
         *([f"* Measured floor: each model's forward + backward at least its step measured on one GPU "
            f"({study.get('compute_floor_source', 'a gpu_profile result')}): "
            + ", ".join(f"{n} {1e3 * v:.1f} ms" for n, v in a["compute_floor_s"].items()) + "."]
           if a.get("compute_floor_s") else []),
         "* Topologies: **flat**, one NIC of the regime's rate per GPU; **nodes_of_8**, 8 GPUs behind one NIC of 8x "
         "the regime's rate, 1000 Gbit/s between the GPUs of a node, rings in node order.",
         f"* EmbRace (e) as built: {a['embrace']['shard_layout']} shards, {a['embrace']['bucket_bytes'] >> 20} MB "
         f"buckets in {a['embrace']['piece_bytes'] >> 20} MB pieces, relaxed embedding dependency off, the tied "
         "output by the automatic rule (stated per row).",
         "* Baselines: " + ", ".join(get_strategy(s).label for s in a["baselines"]) + ". \"c10d comm / floor\" is "
         "c10d's communication seconds over the compute-only step: the share the benchmark's `--regime` "
         "calibration reproduces (there at its own world size).", "",
         "## Headline: (e) over the fastest stock baseline (named), flat", ""]
    L += _headline(study, "flat", worlds)
    for topo in [t for t in a["topologies"] if t != "flat"]:
        L += [f"## (e) over the fastest stock baseline, {topo}", ""] + _headline(study, topo, worlds)
    L += ["Cells: the fastest stock baseline's step over (e)'s (above 1: (e) is faster)"
          + ("; \"stated\": the same without the measured floor." if a.get("compute_floor_s") else "."),
          ""]
    L += ["## The default plan (`--embrace-plan auto`), flat", "",
          "What the planner chooses from the regime's rates (shard: the tables row-sharded, the dense gradients "
          "with the plan's schedule and sizes; stock: the stock step), its step as the simulator prices it over "
          "c10d's, and the best fixed configuration's step (c10d, EmbRace with the 2D schedule, EmbRace FIFO) "
          "over its own (1.00: none is faster).", ""] + _plans(study, "flat", worlds)
    L += ["## Per world size", ""]
    for topo in a["topologies"]:
        for w in worlds:
            L += _detail(study, topo, w)
    return "\n".join(L) + "\n"


def plot(study: dict, path: Path) -> None:
    """Per topology and model: (e)'s speedup over the fastest stock baseline per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, topologies = list(study["models"]), list(study["assumptions"]["topologies"])
    fig, axes = plt.subplots(len(topologies), len(models), figsize=(3.2 * len(models), 3.0 * len(topologies)),
                             squeeze=False, sharey=True)
    for row, topo in enumerate(topologies):
        for ax, name in zip(axes[row], models):
            for i, regime in enumerate(study["assumptions"]["regimes"]):
                sub = sorted(_select(study, name, regime=regime, topology=topo), key=lambda r: r["world_size"])
                ax.plot([r["world_size"] for r in sub], [r["speedup_over_best"] for r in sub], "-o", ms=3,
                        color=f"C{i}", label=regime)
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs")
            ax.set_title(f"{name}, {topo}", fontsize=8)
        axes[row][0].set_ylabel("(e) over fastest baseline")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_projection(stem: Path, command: str, compute_floor: Optional[Path] = None,
                     worlds: Sequence[int] = WORLDS) -> Tuple[List[Path], str]:
    """``stem``.json, .md and .png of :func:`regime_study`, with the command and the commit;
    with ``compute_floor`` (a gpu_profile result), each model's measured step as its floor."""
    from embrace_fairseq.perf.provenance import source_state

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    floors = measured_floors(compute_floor) if compute_floor is not None else None
    study = dict(command=command, source=source_state(), **regime_study(worlds=worlds, compute_floors=floors))
    if compute_floor is not None:
        study["compute_floor_source"] = str(compute_floor)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(study, indent=1))
    md = markdown(study)
    paths[1].write_text(md)
    plot(study, paths[2])
    return paths, md
