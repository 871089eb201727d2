"""Projection of the paper's three model families to 8-64 GPUs (``paper`` command).

Compute comes from stated assumptions (sustained FLOP/s, memory bandwidth), not from
measurement. EmbRace with the schedule (e) is projected as built (strided shards, the
tied output read the way the automatic rule picks) against every registered stock
strategy and the compute-only floor, on one NIC per GPU and on nodes of 8 GPUs, with a
per-message latency the emulated benchmark could not apply (so it is assumed here). On
nodes, (e) with the node-aware exchange (e-n) is projected beside it (not the default).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.prediction import Prediction
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.strategies import FLOOR, SPEEDUP_SUBJECT, get_strategy, strategy_names

# Assumptions for the projection to GPU clusters (stated, not measured):
GPU_SUSTAINED_FLOPS = 30e12  # V100-class, mixed precision, sustained (~24% of 125 TFLOP/s peak)
GPU_MEMORY_BYTES_PER_S = 800e9  # HBM2, for the optimizer step
ADAM_BYTES_PER_PARAM = 32  # fp32 master weight, two moments, gradient: read + write
PAPER_LATENCY_S = 10e-6  # per message step on 10-100 Gbit/s Ethernet/IB (assumed)
GPUS_PER_NODE = 8
NVLINK_GBIT = 1000.0  # inside a node of 8: NVLink-class, ~125 GB/s per GPU each way (assumed)
# the models trained with label smoothing: the vocab-parallel path then sends one more
# statistic per token (a small term of the automatic choice)
LABEL_SMOOTHING = {"transformer_base_wmt_en_de": True}


def _enc_layer(d: int, f: int) -> int:  # self-attention + FFN + 2 layer norms (fairseq layout)
    return 4 * d * d + 4 * d + 2 * d * f + d + f + 4 * d


def _dec_layer(d: int, f: int, cross: bool = True) -> int:
    return (8 * d * d + 8 * d if cross else 4 * d * d + 4 * d) + 2 * d * f + d + f + (6 if cross else 4) * d


def _gpu_profile(name, vocab, dim, layers, tokens, lookups, ctx, n_layers_attn, tied, zipf_s, output_numel_compute,
                 output_tokens=None, extra_params=0, *, flops: float = GPU_SUSTAINED_FLOPS,
                 memory_bytes_per_s: float = GPU_MEMORY_BYTES_PER_S, element_size: int = 2) -> Profile:
    dense = sum(n for _, n in layers)
    out_tokens = output_tokens or tokens
    # training FLOPs: 6 per parameter per token (2 forward, 4 backward), plus attention
    # scores 6 * layers * ctx * d per token, plus the output layer over its tokens
    train_flops = 6.0 * (dense - extra_params) * tokens + 6.0 * n_layers_attn * ctx * dim * tokens
    train_flops += 6.0 * output_numel_compute * out_tokens
    fwd = train_flops / 3 / flops
    params = dense + vocab * dim
    opt = params * ADAM_BYTES_PER_PARAM / memory_bytes_per_s
    return Profile(
        name=name, vocab=vocab, dim=dim, dense_layers=layers, tokens_per_rank=lookups, forward_s=fwd,
        backward_s=2 * fwd, optimizer_s=opt, tied_output=tied, element_size=element_size, id_size=4, zipf_s=zipf_s,
        output_tokens_per_rank=out_tokens,
    )


def paper_profiles(flops: float = GPU_SUSTAINED_FLOPS, memory_bytes_per_s: float = GPU_MEMORY_BYTES_PER_S,
                   element_size: int = 2) -> Dict[str, Profile]:
    """The paper's three model families at their usual sizes (fp16 gradients), on a GPU
    sustaining ``flops`` with ``memory_bytes_per_s`` for the optimizer step."""
    rates = dict(flops=flops, memory_bytes_per_s=memory_bytes_per_s, element_size=element_size)
    d, f = 512, 2048
    tr_layers = [(f"encoder.layers.{i}", _enc_layer(d, f)) for i in range(6)]
    tr_layers += [(f"decoder.layers.{i}", _dec_layer(d, f)) for i in range(6)]
    transformer = _gpu_profile(
        "transformer_base_wmt_en_de", 32768, d, tr_layers, tokens=3500, lookups=7000, ctx=30, n_layers_attn=18,
        tied="gather", zipf_s=1.0, output_numel_compute=32768 * d, **rates,
    )
    d, f, L = 1024, 4096, 16
    lm_layers = [(f"decoder.layers.{i}", _dec_layer(d, f, cross=False)) for i in range(L)]
    # adaptive softmax, cutoffs 20000,60000, factor 4 (fairseq transformer_lm_wiki103)
    head = d * (20000 + 2)
    tail1 = d * (d // 4) + (d // 4) * 40000
    tail2 = d * (d // 16) + (d // 16) * (267744 - 60000)
    lm_layers += [("decoder.adaptive_softmax", head + tail1 + tail2)]
    lm = _gpu_profile(
        "transformer_lm_wikitext103_267k", 267744, d, lm_layers, tokens=3072, lookups=3072, ctx=512, n_layers_attn=L,
        tied=None, zipf_s=1.0, output_numel_compute=0, **rates,
    )
    d, f = 768, 3072
    bert_layers = [("embeddings.position_type_norm", 512 * d + 2 * d + 2 * d)]
    bert_layers += [(f"encoder.layer.{i}", _enc_layer(d, f)) for i in range(12)]
    bert_layers += [("pooler", d * d + d), ("cls.predictions.transform", d * d + d + 2 * d + 30522)]
    bert = _gpu_profile(
        "bert_base", 30522, d, bert_layers, tokens=4096, lookups=4096, ctx=128, n_layers_attn=12, tied="gather",
        zipf_s=1.0, output_numel_compute=30522 * d, output_tokens=int(0.15 * 4096), extra_params=512 * d, **rates,
    )
    return {p.name: p for p in (transformer, lm, bert)}


# The paper's reported figures, as found (abstracts of arXiv 2110.09132 v1 and v2).
PAPER_REPORTED = [
    {
        "claim": "up to 30.66X speedup on 16 GPUs clusters among four popular distributed training baselines",
        "version": "arXiv 2110.09132v1 abstract",
        "source": "https://deepai.com/publication/embrace-accelerating-sparse-communication-for-distributed-training-of-nlp-neural-networks",
    },
    {
        "claim": "up to 2.41X speedup compared to the state-of-the-art distributed training baselines",
        "version": "arXiv 2110.09132v2 abstract",
        "source": "https://paperswithcode.com/paper/embrace-accelerating-sparse-communication-for",
    },
]


UNSCHEDULED = ("embrace_noschedule", "embrace_fifo")  # the schedule's ablation, shown beside (e)
NODE_AWARE = "embrace_node"  # (e) with the node-aware exchange, where there are nodes


def stock_baselines() -> List[str]:
    """Every registered strategy that keeps the table whole, in registration order."""
    return [s for s in strategy_names() if not get_strategy(s).shards_table and s != FLOOR]


@dataclass(frozen=True)
class Topology:
    """How GPUs reach each other: ``ranks_per_node`` GPUs share the node's NIC (the link
    speed of a row) and talk over ``intra_gbit`` inside the node."""

    name: str
    ranks_per_node: int
    intra_gbit: Optional[float]
    description: str


TOPOLOGIES: Tuple[Topology, ...] = (
    Topology("flat", 1, None, "one NIC of the stated speed per GPU"),
    Topology(f"nodes_of_{GPUS_PER_NODE}", GPUS_PER_NODE, NVLINK_GBIT,
             f"{GPUS_PER_NODE} GPUs per node sharing one NIC of the stated speed, {NVLINK_GBIT:g} Gbit/s "
             "(NVLink-class) between the GPUs of a node; rings in node order"),
)

# EmbRace as built: strided shards, the 2D schedule's buckets and pieces for GPUs, no
# relaxed embedding dependency (off by default; it refuses fp16 loss scaling)
AS_BUILT = Options(embrace_bucket_bytes=25 << 20, embrace_piece_bytes=16 << 20, defer_rows=False,
                   shard_layout="strided")
# the one what-if per model: the contiguous shard layout the strided default replaced
WHAT_IF = ("contiguous_shards", replace(AS_BUILT, shard_layout="contiguous"))


def output_choice(prof: Profile, world: int) -> Tuple[Optional[str], Dict[str, int]]:
    """How the built model reads a tied output table on ``world`` GPUs: the automatic rule
    of :mod:`embrace_fairseq.core.vocab_parallel` (vocab-parallel when its bytes are below
    the table all-gather's), and both byte counts; None for an untied model."""
    if prof.tied_output is None:
        return None, {}
    from embrace_fairseq.core.vocab_parallel import VOCAB_PARALLEL, output_bytes  # torch: imported when projecting

    tokens = int(prof.output_tokens_per_rank or prof.tokens_per_rank)
    cost = output_bytes(prof.vocab, prof.dim, [tokens] * world, elem_bytes=prof.element_size,
                        smoothing=LABEL_SMOOTHING.get(prof.name, False))
    path = "vocab_parallel" if cost.choose() == VOCAB_PARALLEL else "gather"
    return path, {"gather": cost.gather_bytes, "vocab_parallel": cost.vocab_parallel_bytes}


def _with_output(prof: Profile, path: Optional[str]) -> Profile:
    """The profile reading its tied table by ``path`` (shallow: shares the cached loads)."""
    p = copy.copy(prof)
    p.tied_output = path
    return p


def _network(link_gbit: float, topo: Topology, latency_s: float) -> Network:
    return Network(link_gbit, latency_s=latency_s, ranks_per_node=topo.ranks_per_node, intra_gbit=topo.intra_gbit)


def projected(prof: Profile, world: int, net: Network, opts: Options) -> dict:
    """One setting: every stock baseline, the floor, the schedule's ablation and (e), with
    the tied output read as the automatic rule picks for this world size."""
    output, output_bytes = output_choice(prof, world)
    p = _with_output(prof, output)
    baselines = stock_baselines()
    preds = {s: predict(p, s, world, net, opts)
             for s in (*baselines, FLOOR, *UNSCHEDULED, SPEEDUP_SUBJECT, NODE_AWARE)}
    step = {s: pr.step_s for s, pr in preds.items()}
    subject = preds[SPEEDUP_SUBJECT]
    best = min(baselines, key=step.__getitem__)
    return {
        "node_aware": _node_aware_row(subject, preds[NODE_AWARE]) if net.per_node(world) not in (1, world) else None,
        "world_size": world, "output": output, "output_bytes_per_rank": output_bytes,
        "step_s": step,
        "speedup_of_embrace_schedule": {s: t / step[SPEEDUP_SUBJECT] for s, t in step.items()},
        "over_floor": {s: t / step[FLOOR] for s, t in step.items()},
        "best_baseline": best, "slowest_baseline": max(baselines, key=step.__getitem__),
        "hidden_share_embrace_schedule": subject.hidden_share,
        "comm_s_embrace_schedule": subject.comm_s,
        "unique_ids_per_rank": p.loads(world, opts.shard_layout).unique_mean,
        "busiest_rows": p.loads(world, opts.shard_layout).busiest_rows,
    }


def _node_aware_row(flat: Prediction, node: Prediction) -> dict:
    """(e-n) against (e): the step, the exchange's two blocking parts and the share of ids
    that still cross between nodes once each node's are merged."""
    return {"step_over_flat": node.step_s / flat.step_s, "dedup_ratio": node.detail["node_dedup_ratio"],
            **{f"{k}_s": {"flat": flat.detail[f"{k}_s"], "node": node.detail[f"{k}_s"]}
               for k in ("exchange_fwd", "grad_rows")}}


def _model_summary(prof: Profile) -> dict:
    return {"vocab": prof.vocab, "dim": prof.dim, "dense_numel": prof.dense_numel, "tied": prof.tied_output is not None,
            "compute_s": {"forward": prof.forward_s, "backward": prof.backward_s, "optimizer": prof.optimizer_s},
            "tokens_per_rank": prof.tokens_per_rank, "output_tokens_per_rank": prof.output_tokens_per_rank,
            "results": []}


def _assumptions(latency_s: float, topologies: Sequence[Topology]) -> dict:
    return {
        "gpu_sustained_flops": GPU_SUSTAINED_FLOPS, "gpu_memory_bytes_per_s": GPU_MEMORY_BYTES_PER_S,
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM, "latency_s": latency_s, "element_size": 2,
        "embrace_piece_bytes": AS_BUILT.embrace_piece_bytes, "embrace_bucket_bytes": AS_BUILT.embrace_bucket_bytes,
        "zero_bucket_numel": AS_BUILT.zero_bucket_numel, "shard_layout": AS_BUILT.shard_layout,
        "relaxed_embedding": AS_BUILT.defer_rows, "what_if": WHAT_IF[0],
        "topologies": {t.name: {"ranks_per_node": t.ranks_per_node, "intra_gbit": t.intra_gbit,
                                "description": t.description} for t in topologies},
        "baselines": stock_baselines(),
    }


def paper_study(links_gbit: Sequence[float] = (10, 25, 100), worlds: Sequence[int] = (8, 16, 32, 64),
                latency_s: float = PAPER_LATENCY_S, topologies: Sequence[Topology] = TOPOLOGIES) -> dict:
    """Every model, topology, link and world size, as built and with the what-if."""
    out = {"assumptions": _assumptions(latency_s, topologies), "paper_reported": PAPER_REPORTED, "models": {}}
    for name, prof in paper_profiles().items():
        m = _model_summary(prof)
        for variant, opts in (("as_built", AS_BUILT), WHAT_IF):
            for topo in topologies:
                for link in links_gbit:
                    net = _network(link, topo, latency_s)
                    m["results"] += [dict(projected(prof, w, net, opts), variant=variant, topology=topo.name,
                                          link_gbit=link) for w in worlds]
        out["models"][name] = m
    return out


def latency_sensitivity(latencies_s: Sequence[float] = (0.0, PAPER_LATENCY_S, 5 * PAPER_LATENCY_S),
                        worlds: Sequence[int] = (16, 64), link_gbit: float = 25.0) -> List[dict]:
    """(e) as built against the fastest stock baseline on one NIC per GPU, for several
    per-message latencies: the term the emulated benchmark could not measure."""
    rows = []
    for name, prof in paper_profiles().items():
        for lat in latencies_s:
            for w in worlds:
                r = projected(prof, w, _network(link_gbit, TOPOLOGIES[0], lat), AS_BUILT)
                rows.append({"model": name, "latency_s": lat, "world_size": w, "link_gbit": link_gbit,
                             "embrace_schedule_s": r["step_s"][SPEEDUP_SUBJECT], "best_baseline": r["best_baseline"],
                             "speedup_over_best": r["speedup_of_embrace_schedule"][r["best_baseline"]]})
    return rows


# ------------------------------------------------------------------ the markdown


def _select(study: dict, model: str, **want) -> List[dict]:
    return [r for r in study["models"][model]["results"] if all(r[k] == v for k, v in want.items())]


def _assumption_lines(study: dict) -> List[str]:
    a = study["assumptions"]
    labels = ", ".join(get_strategy(s).label for s in a["baselines"])
    topo = "; ".join(f"**{n}**: {t['description']}" for n, t in a["topologies"].items())
    return [
        "Assumptions (stated, not measured):", "",
        f"* Compute: a V100-class GPU sustaining {a['gpu_sustained_flops'] / 1e12:g} TFLOP/s in mixed precision; "
        "training FLOPs 6 per parameter per token plus attention scores plus the output layer; backward = 2x "
        f"forward; Adam step {a['adam_bytes_per_param']} bytes per parameter at "
        f"{a['gpu_memory_bytes_per_s'] / 1e9:g} GB/s; fp16 gradients and rows ({a['element_size']} bytes), int32 ids.",
        f"* Latency: **{1e6 * a['latency_s']:g} µs per message step** of every collective (a ring all-reduce "
        "2(N-1) steps, an all-gather, reduce-scatter or AlltoAll N-1), assumed: the emulated benchmark could not "
        "apply latency on its kernel, so no measurement fixes it (sensitivity below). Links at full line rate, no "
        "per-collective software overhead.",
        f"* Topologies: {topo}.",
        f"* EmbRace (e) as built: {a['shard_layout']} shards; a tied output table read by the automatic rule "
        "(vocab-parallel when its bytes are below the table all-gather's, else the table all-gathered; stated per "
        f"row); 2D schedule with {a['embrace_bucket_bytes'] >> 20} MB buckets cut into "
        f"{a['embrace_piece_bytes'] >> 20} MB pieces; the exchange flat and the dense all-reduce one ring (the "
        "defaults); relaxed embedding dependency off (the default; it refuses fp16 loss scaling). On nodes, "
        "(e) with the node-aware exchange is projected beside it (its own section).",
        f"* Baselines (every registered stock strategy): {labels}; ZeRO buckets of "
        f"{a['zero_bucket_numel'] / 1e6:.1f} M elements. "
        "Columns give each baseline's step over (e)'s (above 1: (e) is faster); \"over floor\" is a step over the "
        "compute-only floor's (the same model, no communication).",
        "* Unique ids: Zipf(1.0) over the vocabulary for the stated tokens per GPU.",
        "",
    ]


def _headline(study: dict, worlds: Sequence[int]) -> List[str]:
    topologies = list(study["assumptions"]["topologies"])
    L = ["## Headline: (e) as built over the fastest and the slowest stock baseline", "",
         "| model | topology | link | " + " | ".join(f"{w} GPUs" for w in worlds) + " |",
         "|---|---|---" + "|---" * len(worlds) + "|"]
    for name in study["models"]:
        for topo in topologies:
            for link in sorted({r["link_gbit"] for r in _select(study, name, variant="as_built")}):
                cells = []
                for w in worlds:
                    (r,) = _select(study, name, variant="as_built", topology=topo, link_gbit=link, world_size=w)
                    sp = r["speedup_of_embrace_schedule"]
                    cells.append(f"{sp[r['best_baseline']]:.2f}x ({get_strategy(r['best_baseline']).short}) / "
                                 f"{sp[r['slowest_baseline']]:.2f}x ({get_strategy(r['slowest_baseline']).short})")
                L.append(f"| {name} | {topo} | {link:g} Gbit/s | " + " | ".join(cells) + " |")
    return L + [""]


def _world_table(study: dict, topo: str, world: int) -> List[str]:
    cols = study["assumptions"]["baselines"] + list(UNSCHEDULED)
    L = [f"### {topo}, {world} GPUs", "",
         "| model | output | link | " + " | ".join(get_strategy(s).short for s in cols)
         + " | (e) step ms | (e) over floor | fastest baseline over floor | comm. hidden by (e) |",
         "|---|---|---" + "|---" * len(cols) + "|---|---|---|---|"]
    for name in study["models"]:
        for r in _select(study, name, variant="as_built", topology=topo, world_size=world):
            sp, fl = r["speedup_of_embrace_schedule"], r["over_floor"]
            L.append(f"| {name} | {r['output'] or 'untied'} | {r['link_gbit']:g} Gbit/s | "
                     + " | ".join(f"{sp[s]:.2f}x" for s in cols)
                     + f" | {1e3 * r['step_s'][SPEEDUP_SUBJECT]:.1f} | {fl[SPEEDUP_SUBJECT]:.2f} | "
                     f"{fl[r['best_baseline']]:.2f} ({get_strategy(r['best_baseline']).short}) | "
                     f"{100 * r['hidden_share_embrace_schedule']:.0f}% |")
    return L + [""]


def _node_aware(study: dict, worlds: Sequence[int]) -> List[str]:
    rows = [r for m in study["models"].values() for r in m["results"]
            if r["variant"] == "as_built" and r.get("node_aware")]
    if not rows:
        return []
    topos = sorted({r["topology"] for r in rows})
    L = [f"## Node-aware exchange (e-n) against the flat one (e), {', '.join(topos)}", "",
         "As built otherwise. Each GPU's ids go to a proxy on its node (the fast link), which merges the node's "
         "ids and asks each owner once along its rail; rows and gradient rows take the same hops. Cells: (e-n)'s "
         "step over (e)'s (below 1: node-aware is faster), and the forward exchange, (e) -> (e-n). "
         "'ids across': ids crossing between nodes, node-aware over flat (the Zipf model; measured on real "
         "batches: results/bench/node_dedup.json).", "",
         "| model | topology | link | ids across | " + " | ".join(f"{w} GPUs" for w in worlds) + " |",
         "|---|---|---|---" + "|---" * len(worlds) + "|"]
    for name in study["models"]:
        for topo in topos:
            for link in sorted({r["link_gbit"] for r in rows if r["topology"] == topo}):
                cells, ratio = [], None
                for w in worlds:
                    sel = [r for r in _select(study, name, variant="as_built", topology=topo, link_gbit=link,
                                              world_size=w) if r.get("node_aware")]
                    if not sel:
                        cells.append("-")
                        continue
                    na = sel[0]["node_aware"]
                    ratio, ex = na["dedup_ratio"], na["exchange_fwd_s"]
                    cells.append(f"{na['step_over_flat']:.3f} ({1e3 * ex['flat']:.1f} -> {1e3 * ex['node']:.1f} ms)")
                if ratio is not None:
                    L.append(f"| {name} | {topo} | {link:g} Gbit/s | {ratio:.2f} | " + " | ".join(cells) + " |")
    return L + [""]


def _what_if(study: dict, worlds: Sequence[int], link: float = 25.0) -> List[str]:
    topo = list(study["assumptions"]["topologies"])[0]
    L = [f"## What-if (not built): contiguous shards instead of strided, {topo}, {link:g} Gbit/s", "",
         "(e)'s step with contiguous shards over its step as built (above 1: the strided default is faster).", "",
         "| model | " + " | ".join(f"{w} GPUs" for w in worlds) + " |", "|---" + "|---" * len(worlds) + "|"]
    for name in study["models"]:
        cells = []
        for w in worlds:
            (c,) = _select(study, name, variant=WHAT_IF[0], topology=topo, link_gbit=link, world_size=w)
            (b,) = _select(study, name, variant="as_built", topology=topo, link_gbit=link, world_size=w)
            cells.append(f"{c['step_s'][SPEEDUP_SUBJECT] / b['step_s'][SPEEDUP_SUBJECT]:.3f}")
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    return L + [""]


def _latency_table(rows: List[dict]) -> List[str]:
    if not rows:
        return []
    worlds = sorted({r["world_size"] for r in rows})
    L = [f"## Latency sensitivity ({TOPOLOGIES[0].name}, {rows[0]['link_gbit']:g} Gbit/s)", "",
         "(e) step and its speedup over the fastest stock baseline, per assumed latency per message step.", "",
         "| model | latency | " + " | ".join(f"{w} GPUs" for w in worlds) + " |",
         "|---|---" + "|---" * len(worlds) + "|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        for lat in sorted({r["latency_s"] for r in rows}):
            cells = [f"{1e3 * r['embrace_schedule_s']:.1f} ms, {r['speedup_over_best']:.2f}x "
                     f"({get_strategy(r['best_baseline']).short})"
                     for w in worlds for r in rows if (r["model"], r["latency_s"], r["world_size"]) == (name, lat, w)]
            L.append(f"| {name} | {1e6 * lat:g} µs | " + " | ".join(cells) + " |")
    return L + [""]


def markdown(study: dict) -> str:
    """The projection: assumptions, headline, a table per topology and world size, the
    node-aware exchange on nodes, the what-if, the latency sensitivity (when the study has
    it), the paper's claims."""
    worlds = sorted({r["world_size"] for m in study["models"].values() for r in m["results"]})
    big = [w for w in worlds if w >= 16] or worlds
    L = ["# EmbRace projected to 8-64 GPUs (simulator)", ""] + _assumption_lines(study) + _headline(study, big)
    L += ["Cells: speedup of (e) over the fastest stock baseline / over the slowest (named).", "",
          "## Per world size", ""]
    for topo in study["assumptions"]["topologies"]:
        for w in worlds:
            L += _world_table(study, topo, w)
    L += _node_aware(study, big)
    L += _what_if(study, worlds) + _latency_table(study.get("latency_sensitivity", []))
    L += ["Reported by the paper (as found; no per-model figures were found):", ""]
    for c in study["paper_reported"]:
        L.append(f"* \"{c['claim']}\" ({c['version']}, {c['source']})")
    return "\n".join(L) + "\n"


def plot(study: dict, path: Path) -> None:
    """Per model and topology: (e)'s speedup over the fastest stock baseline per link,
    the band up to the slowest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, topologies = list(study["models"]), list(study["assumptions"]["topologies"])
    fig, axes = plt.subplots(len(topologies), len(models), figsize=(5 * len(models), 3.6 * len(topologies)),
                             squeeze=False)
    for row, topo in enumerate(topologies):
        for ax, name in zip(axes[row], models):
            rows = _select(study, name, variant="as_built", topology=topo)
            for i, link in enumerate(sorted({r["link_gbit"] for r in rows})):
                sub = sorted((r for r in rows if r["link_gbit"] == link), key=lambda r: r["world_size"])
                xs = [r["world_size"] for r in sub]
                best = [r["speedup_of_embrace_schedule"][r["best_baseline"]] for r in sub]
                worst = [r["speedup_of_embrace_schedule"][r["slowest_baseline"]] for r in sub]
                ax.plot(xs, best, "-o", color=f"C{i}", ms=3, label=f"{link:g} Gbit/s, over the fastest baseline")
                ax.fill_between(xs, best, worst, color=f"C{i}", alpha=0.12)
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("speedup of (e), as built")
            ax.set_title(f"{name}, {topo}", fontsize=9)
    axes[0][0].legend(fontsize=6, title="band: up to the slowest baseline", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
