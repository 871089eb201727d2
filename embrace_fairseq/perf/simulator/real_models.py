"""The released models the benchmark's small workloads stand for, as simulator profiles.

Each benchmark workload is a scaled-down model that trains on this CPU; the model it
stands for (:data:`REAL_MODEL_OF`) has the released vocabulary and dimensions. Its
profile on a GPU comes from the same arithmetic as the paper projection
(:func:`.paper._gpu_profile`: 6 training FLOPs per parameter per token, attention
scores, the output layer; an Adam step of 32 bytes per parameter) at a regime's rates
(:mod:`.regimes`), so that a regime says what share of a real step c10d's all-reduce
takes (:func:`.regimes.c10d_comm_ratio`).

Tokens per GPU per step are the released recipes' where one is published, else stated:

* XLM-R base: 250,002 pieces, 12 layers d768 ffn 3072, 514 learned positions, the
  language-model head tied to the table; masked LM over ~8k tokens per GPU (16 sequences
  of 512), 15 % of them scored by the head;
* mBART-large: 250,027 pieces, 12+12 layers d1024 ffn 4096, 1,026 learned positions per
  side, layer-normed embeddings, every table tied; fairseq's fine-tuning recipe's
  ``--max-tokens 1024`` per side;
* M2M-100 418M: 128,112 pieces, 12+12 layers d1024 ffn 4096 (``transformer_wmt_en_de_big``
  with 12 layers each, sinusoidal positions, pre-norm), every table tied (483.9 M parameters
  as counted here; the release calls it 418M); 1,024 tokens per side per GPU, as the bench
  workload states it (fairseq's multilingual recipe's ``--max-tokens 1024``; the 418M
  fine-tuning example runs ``--max-tokens 3840``, which would make compute 3.75x longer);
* GPT-2 small: 50,257 pieces, 12 layers d768 ffn 3072, 1,024 learned positions, tied
  output, 1,024-token context; 8 sequences (8,192 tokens) per GPU (stated);
* ``transformer_base_wmt_en_de`` and ``transformer_lm_wikitext103_267k``: the paper
  projection's profiles (:func:`.paper.paper_profiles`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from embrace_fairseq.perf.simulator.paper import _dec_layer, _enc_layer, _gpu_profile, paper_profiles
from embrace_fairseq.perf.simulator.profile import Profile

#: (sustained FLOP/s, memory bytes/s, bytes per gradient element) -> the model's profile
Rates = Tuple[float, float, int]


@dataclass(frozen=True)
class RealModel:
    """A released model: its name, a one-line description, its profile at given rates."""

    name: str
    description: str
    build: Callable[[float, float, int], Profile]

    def profile(self, regime) -> Profile:
        """The model on one GPU of ``regime`` (a :class:`.regimes.Regime`)."""
        return self.build(regime.sustained_flops, regime.memory_bytes_per_s, regime.wire_bytes)


def _rates(flops: float, memory: float, element_size: int) -> dict:
    return dict(flops=flops, memory_bytes_per_s=memory, element_size=element_size)


def xlmr_base(flops: float, memory: float, element_size: int) -> Profile:
    d, f, vocab, positions, tokens = 768, 3072, 250_002, 514, 8192
    layers: List[Tuple[str, int]] = [("embeddings.positions_norm", positions * d + 2 * d)]
    layers += [(f"encoder.layers.{i}", _enc_layer(d, f)) for i in range(12)]
    layers += [("lm_head.dense_norm_bias", d * d + d + 2 * d + vocab)]
    return _gpu_profile("xlmr_base", vocab, d, layers, tokens=tokens, lookups=tokens, ctx=512, n_layers_attn=12,
                        tied="gather", zipf_s=1.0, output_numel_compute=vocab * d, output_tokens=int(0.15 * tokens),
                        extra_params=positions * d, **_rates(flops, memory, element_size))


def _seq2seq(name: str, vocab: int, tokens: int, learned_positions: int, layernorm_embedding: bool,
             flops: float, memory: float, element_size: int) -> Profile:
    """12+12 pre-norm layers d1024 ffn 4096, every table tied (mBART-large, M2M-100 418M)."""
    d, f, n = 1024, 4096, 12
    side = learned_positions * d + (2 * d if layernorm_embedding else 0)
    layers: List[Tuple[str, int]] = [("encoder.embeddings", side)] if side else []
    layers += [(f"encoder.layers.{i}", _enc_layer(d, f)) for i in range(n)] + [("encoder.layer_norm", 2 * d)]
    layers += [("decoder.embeddings", side)] if side else []
    layers += [(f"decoder.layers.{i}", _dec_layer(d, f)) for i in range(n)] + [("decoder.layer_norm", 2 * d)]
    # attention: self in every layer of both sides, cross in the decoder's; sentence pairs of ~30 tokens
    return _gpu_profile(name, vocab, d, layers, tokens=tokens, lookups=2 * tokens, ctx=30, n_layers_attn=3 * n,
                        tied="gather", zipf_s=1.0, output_numel_compute=vocab * d,
                        extra_params=2 * learned_positions * d, **_rates(flops, memory, element_size))


def mbart_large(flops: float, memory: float, element_size: int) -> Profile:
    return _seq2seq("mbart_large", 250_027, 1024, 1026, True, flops, memory, element_size)


def m2m100_418m(flops: float, memory: float, element_size: int) -> Profile:
    return _seq2seq("m2m100_418m", 128_112, 1024, 0, False, flops, memory, element_size)


def gpt2_small(flops: float, memory: float, element_size: int) -> Profile:
    d, f, vocab, ctx, tokens = 768, 3072, 50_257, 1024, 8192
    layers: List[Tuple[str, int]] = [("decoder.embed_positions", ctx * d)]
    layers += [(f"decoder.layers.{i}", _dec_layer(d, f, cross=False)) for i in range(12)]
    layers += [("decoder.layer_norm", 2 * d)]
    return _gpu_profile("gpt2_small", vocab, d, layers, tokens=tokens, lookups=tokens, ctx=ctx, n_layers_attn=12,
                        tied="gather", zipf_s=1.0, output_numel_compute=vocab * d, extra_params=ctx * d,
                        **_rates(flops, memory, element_size))


def _paper(name: str) -> Callable[[float, float, int], Profile]:
    def build(flops: float, memory: float, element_size: int) -> Profile:
        return paper_profiles(flops, memory, element_size)[name]

    return build


REAL_MODELS: Dict[str, RealModel] = {m.name: m for m in (
    RealModel("xlmr_base", "XLM-R base: 250,002 vocab, 12 layers d768 ffn 3072, tied LM head, masked LM 15 % of "
              "8,192 tokens per GPU", xlmr_base),
    RealModel("mbart_large", "mBART-large: 250,027 vocab, 12+12 layers d1024 ffn 4096, tied, 1,024 tokens per side "
              "per GPU", mbart_large),
    RealModel("m2m100_418m", "M2M-100 418M: 128,112 vocab, 12+12 layers d1024 ffn 4096, tied, 1,024 tokens per "
              "side per GPU", m2m100_418m),
    RealModel("transformer_base_wmt_en_de", "Transformer base (WMT en-de): 32,768 vocab, 6+6 layers d512 ffn 2048, "
              "tied, 3,500 tokens per side per GPU", _paper("transformer_base_wmt_en_de")),
    RealModel("transformer_lm_wikitext103_267k", "Transformer LM (WikiText-103): 267,744 vocab, 16 layers d1024 ffn "
              "4096, adaptive softmax (untied), 3,072 tokens per GPU", _paper("transformer_lm_wikitext103_267k")),
    RealModel("gpt2_small", "GPT-2 small: 50,257 vocab, 12 layers d768 ffn 3072, tied, 8 x 1,024 tokens per GPU",
              gpt2_small),
)}

#: benchmark workload -> the released model it stands for
REAL_MODEL_OF: Dict[str, str] = {
    "xlmr": "xlmr_base", "mbart": "mbart_large", "m2m": "m2m100_418m",
    "translation": "transformer_base_wmt_en_de", "lm": "transformer_lm_wikitext103_267k", "gpt_lm": "gpt2_small",
}


def real_model_of(workload: str) -> RealModel:
    """The released model a benchmark workload stands for; ``ValueError`` naming the known ones."""
    try:
        return REAL_MODELS[REAL_MODEL_OF[workload]]
    except KeyError:
        raise ValueError(f"no real model is known for the workload {workload!r}; the regimes know "
                         f"{', '.join(sorted(REAL_MODEL_OF))}") from None
