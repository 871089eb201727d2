"""The released models the benchmark's workloads are named after, and how the bench keeps their shape.

A workload named after a released model keeps (a) its vocabulary: the exact row count of
the released dictionary, and (b) its embedding share: token table rows x dim over all
parameters (a tied table counted once), within :data:`SHARE_TOLERANCE`; width and depth
are small so that a CPU rank can step it, and the feed-forward width is what sets the share
(:func:`ffn_for_share`). Tokens per rank are the published training's or the workload says
why not (:data:`TOKENS_NOTE`). A workload that stands for no released model is
*synthetic* (:data:`SYNTHETIC`): reported apart, with no goal.

Real models, parameters counted as fairseq builds the architecture from the published
dims (:func:`.large_vocab.parameters`):

* Transformer base (``transformer_wmt_en_de``, the WMT'16 en-de recipe of fairseq's
  scaling-NMT example): 6+6 layers, d 512, ffn 2048, sinusoidal positions, post-norm, one
  joint BPE table for both sides and the output (``--share-all-embeddings``) of 32,768 rows:
  60.9M parameters, table 27.5 %; 3,584 tokens per GPU (``--max-tokens 3584``).
* GPT-2 small: 12 layers, d 768, ffn 3072, 1,024 learned positions, final layer norm, the
  output tied to the 50,257-row table: 124.4M parameters, table 31.0 %; 8 sequences of
  1,024 tokens per GPU (the paper gives 512 sequences per batch and no GPU count).
* XLM-R base, mBART-large, M2M-100 418M: :mod:`.large_vocab`.

Buckets scale with the model (:func:`bucket_scale`): the bench's gradient bytes over the
real model's (fp16, as the published trainings ran), so that every strategy's buckets,
each its experts' setting times that factor, split the bench model into as many buckets
as they split the real one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Optional

from embrace_fairseq.perf.bench import large_vocab as LV

#: the largest distance, in points of share, of a named workload's embedding share from its model's
SHARE_TOLERANCE = 0.05
#: bytes per gradient element of the published trainings (fp16) and of the bench (fp32 CPU ranks)
REAL_GRAD_BYTES = 2
BENCH_GRAD_BYTES = 4


@dataclass(frozen=True)
class RealModel:
    """A released model: its name, its dims and the tokens one GPU processed per forward."""

    name: str
    shape: LV.Shape
    tokens_per_gpu: int

    @property
    def parameters(self) -> int:
        return LV.parameters(self.shape)[1]

    @property
    def embedding_share(self) -> float:
        return LV.embedding_share(self.shape)


#: workload -> the released model it is named after (module docstring)
REAL: Dict[str, RealModel] = {
    "translation": RealModel("Transformer base (WMT'16 en-de)", LV.Shape(32_768, 512, 6, 6, 2048), 3584),
    "gpt_lm": RealModel("GPT-2 small", LV.Shape(50_257, 768, 12, 0, 3072, learned_positions=1024,
                                                final_layer_norm=True), 8 * 1024),
    **{name: RealModel(title, shape, tokens) for name, (title, shape), tokens in
       ((n, LV.REAL[n], t) for n, t in (("xlmr", 16 * 512), ("mbart", 1024), ("m2m", 1024)))},
}

#: workloads that stand for no released model: why not (reported apart, no goal)
SYNTHETIC: Dict[str, str] = {
    "lm": "a word-level LM over 66k types with an untied input table and an adaptive softmax: the released "
          "WikiText-103 LM ties adaptive input to adaptive softmax (about 247M parameters) and has no large untied "
          "table, so no released model has this shape",
    "iwslt": "transformer_iwslt_de_en's dims over the bench's joint 8k vocabulary with only the decoder's table "
             "tied: not the released IWSLT'14 model's dictionaries",
}

#: named workloads whose tokens per rank are fewer than the published training's, and why
TOKENS_NOTE: Dict[str, str] = {
    "translation": "512 tokens per rank instead of 3,584: the schedule's ablations time 8+ steps of 5-8 strategies "
                   "on 2 cores",
    "gpt_lm": "4 x 128 tokens per rank instead of 8 x 1,024: a full softmax over 50,257 rows per token on one "
              "core per rank",
}


def is_synthetic(workload: str) -> bool:
    """Whether ``workload`` stands for no released model (reported apart, no goal)."""
    return workload in SYNTHETIC


def real_model(workload: str) -> Optional[RealModel]:
    """The released model ``workload`` is named after (None for a synthetic one)."""
    return REAL.get(workload)


def ffn_for_share(shape: LV.Shape, share: float, multiple: int = 64) -> int:
    """The feed-forward width (a multiple of ``multiple``) that brings ``shape``'s embedding
    share nearest to ``share``: the parameters grow linearly with the width, so the width is
    solved for and rounded.

    >>> s = LV.Shape(50_257, 64, 2, 0, 0)
    >>> f = ffn_for_share(s, 0.31); round(LV.embedding_share(replace(s, ffn=f)), 3)
    0.31
    """
    if not 0.0 < share < 1.0:
        raise ValueError(f"an embedding share lies strictly between 0 and 1, got {share}")
    table, at0 = LV.parameters(replace(shape, ffn=0))
    per_unit = LV.parameters(replace(shape, ffn=1))[1] - at0
    want = table * (1.0 - share) / share  # every parameter but the table
    units = (want - (at0 - table)) / per_unit
    if units <= 0:
        raise ValueError(f"the shape without a feed-forward layer already has share {table / at0:.3f} < {share}")
    return max(multiple, multiple * round(units / multiple))


def share_gap(workload_shape: LV.Shape, real: RealModel) -> float:
    """The workload's embedding share less its real model's, in share (0.05 = 5 points)."""
    return LV.embedding_share(workload_shape) - real.embedding_share


def bucket_scale(bench_numel: int, real_numel: int, bench_bytes: int = BENCH_GRAD_BYTES,
                 real_bytes: int = REAL_GRAD_BYTES) -> float:
    """The factor a bucket's bytes scale by: the bench's gradient bytes over the real
    model's (a bucket of ``f`` times the real bucket's bytes then holds the same share of
    the model, so the bench has as many buckets).

    >>> bucket_scale(10_000_000, 125_000_000)   # 40 MB of fp32 over 250 MB of fp16
    0.16
    """
    if bench_numel <= 0 or real_numel <= 0:
        raise ValueError(f"bucket scaling needs positive parameter counts, got {bench_numel} and {real_numel}")
    return (bench_numel * bench_bytes) / (real_numel * real_bytes)


#: the experts' settings, in bytes of the real model's gradients (fp16) unless named ``numel``:
#: torch DDP as fairseq passes it (``--bucket-cap-mb 25``; with a cap given torch caps the
#: first bucket at it too, else at ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB); DeepSpeed ZeRO's
#: ``reduce_bucket_size`` / ``allgather_bucket_size`` (elements; 5e8 as the ZeRO tutorial and
#: the config's default set them); EmbRace's defaults (4 MB buckets, 1 MB pieces).
EXPERT_BUCKETS: Dict[str, float] = {
    "ddp_bucket_bytes": 25 * 2**20,
    "ddp_first_bucket_bytes": 1 * 2**20,
    "zero_reduce_bucket_numel": 5e8,
    "zero_allgather_bucket_numel": 5e8,
    "embrace_bucket_bytes": 4 * 2**20,
    "embrace_piece_bytes": 1 * 2**20,
}


def scaled_buckets(bench_numel: Optional[int], real_numel: Optional[int], bench_bytes: int = BENCH_GRAD_BYTES,
                   real_bytes: int = REAL_GRAD_BYTES) -> Dict[str, object]:
    """Every strategy's bucket setting for a bench model of ``bench_numel`` parameters
    standing for a real one of ``real_numel`` (None: a synthetic workload, the experts'
    settings as they are, and ``bench_numel`` may be None too): each expert setting of :data:`EXPERT_BUCKETS` times
    :func:`bucket_scale`, element counts converted through the gradient bytes (a ZeRO bucket
    of ``n`` real elements holds ``n * real_bytes`` bytes; the bench's the same bytes times the
    factor, over ``bench_bytes`` per element). Also what the split gives: the buckets each
    setting makes of the real model and of the bench model (the same count up to rounding).

    >>> b = scaled_buckets(10_000_000, 125_000_000)
    >>> b["scale"], b["ddp_bucket_cap_mb"], b["real_buckets"]["ddp"], b["bench_buckets"]["ddp"]
    (0.16, 4.0, 11, 11)
    """
    scale = 1.0 if real_numel is None else bucket_scale(bench_numel, real_numel, bench_bytes, real_bytes)
    e = EXPERT_BUCKETS
    # DeepSpeed's ZeRO takes bucket sizes in multiples of its start alignment (2 elements)
    reduce_numel = _even(e["zero_reduce_bucket_numel"] * real_bytes * scale / bench_bytes)
    gather_numel = _even(e["zero_allgather_bucket_numel"] * real_bytes * scale / bench_bytes)
    out: Dict[str, object] = {
        "scale": scale,
        "real_numel": real_numel,
        "bench_numel": None if bench_numel is None else int(bench_numel),
        "ddp_bucket_cap_mb": e["ddp_bucket_bytes"] * scale / 2**20,
        "ddp_first_bucket_mb": e["ddp_first_bucket_bytes"] * scale / 2**20,
        "zero_reduce_bucket_size": reduce_numel,
        "zero_allgather_bucket_size": gather_numel,
        "embrace_bucket_mb": e["embrace_bucket_bytes"] * scale / 2**20,
        "embrace_piece_mb": e["embrace_piece_bytes"] * scale / 2**20,
        "expert": dict(e),
    }
    if real_numel is not None:
        out["real_buckets"] = _counts(real_numel * real_bytes, 1.0)
    if bench_numel is not None:
        out["bench_buckets"] = _counts(bench_numel * bench_bytes, scale)
    return out


def _even(numel: float) -> int:
    """``numel`` rounded to a multiple of 2, at least 2 (ZeRO's ``nccl_start_alignment_factor``).

    >>> _even(7.9), _even(0.3), _even(10)
    (8, 2, 10)
    """
    return max(2, 2 * int(round(numel / 2)))


def _counts(grad_bytes: float, scale: float) -> Dict[str, int]:
    """How many buckets each expert setting, times ``scale``, makes of ``grad_bytes`` (the
    parameters' sizes ignored: the count a flat split gives)."""
    e = EXPERT_BUCKETS
    zero = e["zero_reduce_bucket_numel"] * REAL_GRAD_BYTES * scale  # ZeRO's elements hold the real model's bytes
    first = e["ddp_first_bucket_bytes"] * scale
    ddp = 1 if grad_bytes <= first else 1 + n_of(grad_bytes - first, e["ddp_bucket_bytes"] * scale)
    return {"ddp": ddp, "zero_reduce": n_of(grad_bytes, zero), "embrace": n_of(grad_bytes, e["embrace_bucket_bytes"] * scale)}


def n_of(grad_bytes: float, cap: float) -> int:
    """Buckets of at most ``cap`` bytes a flat split of ``grad_bytes`` makes."""
    return max(1, math.ceil(grad_bytes / cap))


def describe(workload: str, bench_shape: Optional[LV.Shape], tokens_per_rank: int) -> Dict[str, object]:
    """A workload's shape against its real model's (pure; what the reports print):
    the real model and its vocabulary, parameters and embedding share; the workload's; the
    gap in points; tokens per rank and, where fewer than published, why; or, for a synthetic
    workload, why it stands for no released model."""
    real = real_model(workload)
    out: Dict[str, object] = {"synthetic": is_synthetic(workload) or real is None,
                              "synthetic_reason": SYNTHETIC.get(workload),
                              "tokens_per_rank": tokens_per_rank}
    if real is None:
        return out
    table, total = LV.parameters(real.shape)
    out.update(real_model=real.name, real_vocab=real.shape.vocab, real_parameters=total,
               real_embedding_share=table / total, real_tokens_per_gpu=real.tokens_per_gpu,
               tokens_note=TOKENS_NOTE.get(workload))
    if bench_shape is not None:
        out.update(vocab=bench_shape.vocab, parameters=LV.parameters(bench_shape)[1],
                   embedding_share=LV.embedding_share(bench_shape),
                   share_gap_points=100.0 * share_gap(bench_shape, real))
    return out


def real_numel(workload: str) -> Optional[int]:
    """The parameters of the released model ``workload`` is named after (None: synthetic)."""
    real = real_model(workload)
    return None if real is None else real.parameters

