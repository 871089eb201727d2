"""Projection of the paper's three model families to 8-64 GPUs (``paper`` command).

Compute comes from stated assumptions (sustained FLOP/s, memory bandwidth), not from
measurement; the table and plot compare EmbRace with the schedule to every baseline.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Dict, Sequence

from embrace_fairseq.perf.simulator.network import Network
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, STRATEGIES, get_strategy

# Assumptions for the projection to GPU clusters (stated, not measured):
GPU_SUSTAINED_FLOPS = 30e12  # V100-class, mixed precision, sustained (~24% of 125 TFLOP/s peak)
GPU_MEMORY_BYTES_PER_S = 800e9  # HBM2, for the optimizer step
ADAM_BYTES_PER_PARAM = 32  # fp32 master weight, two moments, gradient: read + write
PAPER_LATENCY_S = 10e-6  # per message step on 10-100 Gbit/s Ethernet/IB (assumed)


def _enc_layer(d: int, f: int) -> int:  # self-attention + FFN + 2 layer norms (fairseq layout)
    return 4 * d * d + 4 * d + 2 * d * f + d + f + 4 * d


def _dec_layer(d: int, f: int, cross: bool = True) -> int:
    return (8 * d * d + 8 * d if cross else 4 * d * d + 4 * d) + 2 * d * f + d + f + (6 if cross else 4) * d


def _gpu_profile(name, vocab, dim, layers, tokens, lookups, ctx, n_layers_attn, tied, zipf_s, output_numel_compute,
                 output_tokens=None, extra_params=0) -> Profile:
    dense = sum(n for _, n in layers)
    out_tokens = output_tokens or tokens
    # training FLOPs: 6 per parameter per token (2 forward, 4 backward), plus attention
    # scores 6 * layers * ctx * d per token, plus the output layer over its tokens
    flops = 6.0 * (dense - extra_params) * tokens + 6.0 * n_layers_attn * ctx * dim * tokens
    flops += 6.0 * output_numel_compute * out_tokens
    fwd = flops / 3 / GPU_SUSTAINED_FLOPS
    params = dense + vocab * dim
    opt = params * ADAM_BYTES_PER_PARAM / GPU_MEMORY_BYTES_PER_S
    return Profile(
        name=name, vocab=vocab, dim=dim, dense_layers=layers, tokens_per_rank=lookups, forward_s=fwd,
        backward_s=2 * fwd, optimizer_s=opt, tied_output=tied, element_size=2, id_size=4, zipf_s=zipf_s,
        output_tokens_per_rank=out_tokens,
    )


def paper_profiles() -> Dict[str, Profile]:
    """The paper's three model families at their usual sizes (fp16 gradients)."""
    d, f = 512, 2048
    tr_layers = [(f"encoder.layers.{i}", _enc_layer(d, f)) for i in range(6)]
    tr_layers += [(f"decoder.layers.{i}", _dec_layer(d, f)) for i in range(6)]
    transformer = _gpu_profile(
        "transformer_base_wmt_en_de", 32768, d, tr_layers, tokens=3500, lookups=7000, ctx=30, n_layers_attn=18,
        tied="gather", zipf_s=1.0, output_numel_compute=32768 * d,
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
        tied=None, zipf_s=1.0, output_numel_compute=0,
    )
    d, f = 768, 3072
    bert_layers = [("embeddings.position_type_norm", 512 * d + 2 * d + 2 * d)]
    bert_layers += [(f"encoder.layer.{i}", _enc_layer(d, f)) for i in range(12)]
    bert_layers += [("pooler", d * d + d), ("cls.predictions.transform", d * d + d + 2 * d + 30522)]
    bert = _gpu_profile(
        "bert_base", 30522, d, bert_layers, tokens=4096, lookups=4096, ctx=128, n_layers_attn=12, tied="gather",
        zipf_s=1.0, output_numel_compute=30522 * d, output_tokens=int(0.15 * 4096), extra_params=512 * d,
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



def _model_summary(prof: Profile) -> dict:
    return {"vocab": prof.vocab, "dim": prof.dim, "dense_numel": prof.dense_numel, "tied_output": prof.tied_output,
            "compute_s": {"forward": prof.forward_s, "backward": prof.backward_s, "optimizer": prof.optimizer_s},
            "tokens_per_rank": prof.tokens_per_rank, "results": []}


def _variants(prof: Profile, opts: Options) -> list:
    """As built, and the what-ifs: strided shards; for a tied output, the table overlapped
    and a vocab-parallel output layer."""
    strided = Options(**{**asdict(opts), "shard_layout": "strided"})
    variants = [("as_built", prof, opts), ("strided_shards", prof, strided)]
    if prof.tied_output == "gather":
        variants.append(("overlapped_table", prof, Options(**{**asdict(opts), "overlap_table": True})))
        vp = Profile(**{**asdict(prof), "tied_output": "vocab_parallel"})
        variants.append(("vocab_parallel_output", vp, opts))
    return variants


def _result(variant: str, p: Profile, o: Options, link: float, w: int) -> dict:
    net = Network(link, latency_s=PAPER_LATENCY_S)
    preds = {s: predict(p, s, w, net, o) for s in STRATEGIES}
    subject = preds[SPEEDUP_SUBJECT]
    no_defer = predict(p, SPEEDUP_SUBJECT, w, net, Options(**{**asdict(o), "defer_rows": False}))
    return {
        "variant": variant, "link_gbit": link, "world_size": w,
        "step_s": {s: pr.step_s for s, pr in preds.items()},
        "speedup_of_embrace_schedule": {s: pr.step_s / subject.step_s for s, pr in preds.items()},
        "hidden_share_embrace_schedule": subject.hidden_share,
        "embrace_schedule_without_row_deferral_s": no_defer.step_s,
        "unique_ids_per_rank": p.loads(w, o.shard_layout).unique_mean,
        "busiest_rows": p.loads(w, o.shard_layout).busiest_rows,
        "deferred_share": subject.detail.get("deferred_share"),
    }


def paper_study(links_gbit: Sequence[float] = (10, 25, 100), worlds: Sequence[int] = (8, 16, 32, 64)) -> dict:
    out = {"assumptions": {
        "gpu_sustained_flops": GPU_SUSTAINED_FLOPS, "gpu_memory_bytes_per_s": GPU_MEMORY_BYTES_PER_S,
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM, "latency_s": PAPER_LATENCY_S, "element_size": 2,
        "embrace_piece_bytes": 16 << 20, "embrace_bucket_bytes": 25 << 20,
    }, "paper_reported": PAPER_REPORTED, "models": {}}
    opts = Options(embrace_bucket_bytes=25 << 20, embrace_piece_bytes=16 << 20)
    for name, prof in paper_profiles().items():
        m = _model_summary(prof)
        for variant, p, o in _variants(prof, opts):
            m["results"] += [_result(variant, p, o, link, w) for link in links_gbit for w in worlds]
        out["models"][name] = m
    return out


_OUTPUT_OF_VARIANT = {
    "as_built": "{tied}",
    "strided_shards": "{tied}, strided shards (what-if)",
    "overlapped_table": "gather prefetched, reduce-scatter deferred (what-if)",
    "vocab_parallel_output": "vocab-parallel (design)",
}


def markdown(study: dict, world: int = 16) -> str:
    """The predicted speedups of the subject strategy over each other one at ``world`` GPUs."""
    others = [s for s in STRATEGIES if s != SPEEDUP_SUBJECT]
    lines = [
        f"Predicted speedup of EmbRace with the schedule (e) over each baseline, {world} GPUs",
        "",
        "| model | output | link | " + " | ".join(get_strategy(s).short for s in others)
        + " | gain of row deferral | comm. hidden by (e) |",
        "|---|---|---" + "|---" * len(others) + "|---|---|",
    ]
    for name, m in study["models"].items():
        for r in m["results"]:
            if r["world_size"] != world:
                continue
            s = r["speedup_of_embrace_schedule"]
            out = _OUTPUT_OF_VARIANT[r["variant"]].format(tied=m["tied_output"] or "untied")
            lines.append(
                f"| {name} | {out} | {r['link_gbit']:g} Gbit/s | " + " | ".join(f"{s[o]:.2f}x" for o in others) + " | "
                f"{r['embrace_schedule_without_row_deferral_s'] / r['step_s'][SPEEDUP_SUBJECT]:.2f}x | "
                f"{100 * r['hidden_share_embrace_schedule']:.0f}% |"
            )
    lines += ["", "Reported by the paper (as found; no per-model figures were found):", ""]
    for c in study["paper_reported"]:
        lines.append(f"* \"{c['claim']}\" ({c['version']}, {c['source']})")
    return "\n".join(lines) + "\n"


# the baselines drawn in the plot, one colour each
PLOTTED = ("fairseq_legacy_ddp", "deepspeed", "sparse_allgather", "embrace_noschedule")


def plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(study["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = [r for r in study["models"][name]["results"] if r["variant"] == "as_built"]
        for link, style in zip(sorted({r["link_gbit"] for r in rows}), ("-", "--", ":")):
            sub = sorted((r for r in rows if r["link_gbit"] == link), key=lambda r: r["world_size"])
            xs = [r["world_size"] for r in sub]
            for i, base in enumerate(PLOTTED):
                ax.plot(xs, [r["speedup_of_embrace_schedule"][base] for r in sub], style, color=f"C{i}",
                        label=f"vs {base}, {link:g} Gbit/s")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speedup of EmbRace (schedule)")
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
