"""Large-vocabulary workloads shaped after XLM-R base, mBART-large and M2M-100 418M.

Each keeps its model's vocabulary (the exact row count of its released dictionary), the
tokens one rank processes per forward in its published training, and its embedding share
of the parameters (token table rows x dim over all parameters, a tied table counted
once); width and depth are free and small, so that a CPU rank can step it.

**Real models** (parameters counted as fairseq builds the architecture with the published
dims, :func:`real_parameters`):

* XLM-R base (fairseq ``roberta_base`` dims with the ``xlmr.base`` dictionary): 12 layers,
  d 768, ffn 3072, 514 learned positions, embedding layer norm, LM head (dense, layer
  norm, ``V``-sized bias) tied to the table; 250,002 rows (4 specials, 249,997 pieces,
  ``<mask>``): 278.3M parameters, table 69.0 %.
* mBART-large (``mbart_large``, ``mbart.cc25``): 12+12 layers, d 1024, ffn 4096, 1026
  learned positions per side, embedding layer norms, final layer norms, one table for the
  encoder, the decoder and the output; 250,027 rows (4 specials, 249,997 pieces, 25
  ``[xx_XX]`` language tokens, ``<mask>``): 610.9M parameters (the release says 610M),
  table 41.9 %.
* M2M-100 418M (the ``418M_last_checkpoint.pt`` of fairseq's ``examples/m2m_100``, as
  its conversion for transformers (``facebook/m2m100_418M``) states the dims: 12 encoder +
  12 decoder layers, so 24 in all, d 1024, ffn 4096, 16 heads, sinusoidal positions,
  pre-norm with final layer norms, no embedding layer norm, all embeddings shared; the
  ``transformer_wmt_en_de_big`` widths with 12+12 layers); 128,112 rows (4 specials,
  128,000 pieces, 100 ``__xx__`` language tokens, 8 ``madeupword`` fillers to a multiple
  of 8): 483.9M parameters by these dims (the release's name says 418M), table 27.1 %.

**Tokens per rank** (per forward, no accumulation):

* ``xlmr``: XLM-R was trained with batches of 8192 sequences of 512 tokens on 500 GPUs,
  8,389 tokens per GPU: 16 sequences of 512 (8,192 tokens), blocks of 511 pieces after a
  ``<s>`` as fairseq's ``masked_lm`` task cuts them (``--sample-break-mode none``).
  Masked share 15 % with fairseq's defaults, as BERT, RoBERTa and XLM-R: of the chosen
  positions 80 % become ``<mask>``, 10 % a random row, 10 % stay (fairseq's
  :class:`~fairseq.data.MaskTokensDataset`, seeded per block).
* ``mbart``: the mBART paper gives "around 128K tokens per GPU" in total, not one
  forward's; the released fairseq recipe (``examples/mbart/README.md``, fine-tuning on
  EN-RO) runs ``--max-tokens 1024 --update-freq 2``: 1024 tokens per forward. Objective:
  translation (the recipe's ``translation_from_pretrained_bart``), German -> English:
  source ``x </s> [de_DE]``, target ``y </s> [en_XX]``, the decoder starting from
  ``[en_XX]``.
* ``m2m``: the M2M-100 README sends its training to fairseq's multilingual translation
  recipe (``examples/multilingual/README.md``), which runs ``--max-tokens 1024
  --update-freq 2``: 1024 tokens per forward. Objective: multilingual translation in both
  directions of the German-English corpus, with M2M-100's ``--encoder-langtok src
  --decoder-langtok``: source ``__de__ x </s>`` (or ``__en__``), target ``__en__ y </s>``.

The compute target of about 1.5 s per step on one core is not reachable with these token
counts: the dense parameters a share fixes (``(1 - share) / share`` times the table, so
proportional to the width) pass every token through feed-forward layers whose hidden
units number ``dense / (2 d)``, the same at any width, and the output layer of the masked
or target positions is ``V`` wide at any width. The tokens are kept and the width is
small (d 16, two heads, 2 layers per stack, the feed-forward width chosen for the share).
Measured on this 2-core machine while other jobs ran (one rank alone, forward + backward
+ Adam): ``xlmr`` about 13 s and a peak of 7.3 GB per rank (the masked positions' logits
over 250k rows and the feed-forward activations of 8,192 tokens), ``m2m`` about 3.6 s and
2.9 GB, ``mbart`` about 16 s and 4.5 GB; the benchmark's profiles record each run's own
times.

**Text**: the German-English LibreOffice help of ``data/deen`` as the prepared data
binarised it (the joint 8k sentencepiece model of ``data/deen/spm``, fairseq's joined
dictionary sorted by frequency). Its pieces are placed in the large table by
:func:`spread_rows`; every other row is a real dictionary symbol, so fairseq builds a
table of exactly the real row count. Dictionaries, row maps and the masked LM's streams
are cached under the benchmark's cache folder, written atomically.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

#: fairseq's ``Dictionary()`` specials: ``<s>``, ``<pad>``, ``</s>``, ``<unk>``
N_SPECIALS = 4
#: the seed of :func:`spread_rows`
SPREAD_SEED = 1

#: ``mbart.cc25``'s languages, in its ``--langs`` order (examples/mbart/README.md)
MBART_LANGS = ("ar_AR,cs_CZ,de_DE,en_XX,es_XX,et_EE,fi_FI,fr_XX,gu_IN,hi_IN,it_IT,ja_XX,kk_KZ,ko_KR,lt_LT,lv_LV,"
               "my_MM,ne_NP,nl_XX,ro_RO,ru_RU,si_LK,tr_TR,vi_VN,zh_CN").split(",")
#: M2M-100's 100 languages, in its dictionary's order
M2M_LANGS = ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr "
             "ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa "
             "pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu").split()


@dataclass(frozen=True)
class VocabLayout:
    """A released dictionary's rows: the 4 specials, the sentencepiece rows, then the
    symbols fairseq adds after them (language tokens, ``<mask>``, fillers)."""

    piece_rows: int
    extra: Tuple[str, ...]

    @property
    def rows(self) -> int:
        return N_SPECIALS + self.piece_rows + len(self.extra)


LAYOUTS: Dict[str, VocabLayout] = {
    "xlmr": VocabLayout(249_997, ("<mask>",)),
    "mbart": VocabLayout(249_997, tuple(f"[{l}]" for l in MBART_LANGS) + ("<mask>",)),
    "m2m": VocabLayout(128_000, tuple(f"__{l}__" for l in M2M_LANGS) + tuple(f"madeupword{i:04d}" for i in range(8))),
}


@dataclass(frozen=True)
class Shape:
    """The dims that set a model's parameter count (fairseq's names)."""

    vocab: int
    dim: int
    encoder_layers: int
    decoder_layers: int  # 0: encoder only (RoBERTa)
    ffn: int
    learned_positions: int = 0  # rows of each side's learned positional table (0: sinusoidal)
    layernorm_embedding: bool = False
    final_layer_norm: bool = False  # pre-norm stacks end with a layer norm
    lm_head: bool = False  # RoBERTa's masked-LM head: dense + layer norm + V-sized bias (weight tied)


#: the real models, from their published dims (module docstring)
REAL: Dict[str, Tuple[str, Shape]] = {
    "xlmr": ("XLM-R base", Shape(250_002, 768, 12, 0, 3072, learned_positions=514, layernorm_embedding=True,
                                 lm_head=True)),
    "mbart": ("mBART-large (mbart.cc25)", Shape(250_027, 1024, 12, 12, 4096, learned_positions=1026,
                                                layernorm_embedding=True, final_layer_norm=True)),
    "m2m": ("M2M-100 418M", Shape(128_112, 1024, 12, 12, 4096, final_layer_norm=True)),
}


def _layer_norm(d: int) -> int:
    return 2 * d


def _linear(i: int, o: int) -> int:
    return i * o + o


def encoder_layer_parameters(d: int, ffn: int) -> int:
    """Self-attention (q, k, v, out), feed-forward, two layer norms."""
    return 4 * _linear(d, d) + _linear(d, ffn) + _linear(ffn, d) + 2 * _layer_norm(d)


def decoder_layer_parameters(d: int, ffn: int) -> int:
    """Self-attention, encoder attention, feed-forward, three layer norms."""
    return 8 * _linear(d, d) + _linear(d, ffn) + _linear(ffn, d) + 3 * _layer_norm(d)


def parameters(s: Shape) -> Tuple[int, int]:
    """(token table, all parameters) of a model of this shape as fairseq builds it (a tied
    table counted once)."""
    table = s.vocab * s.dim
    sides = 2 if s.decoder_layers else 1
    dense = sides * s.learned_positions * s.dim
    dense += sides * _layer_norm(s.dim) * (int(s.layernorm_embedding) + int(s.final_layer_norm))
    dense += s.encoder_layers * encoder_layer_parameters(s.dim, s.ffn)
    dense += s.decoder_layers * decoder_layer_parameters(s.dim, s.ffn)
    if s.lm_head:
        dense += _linear(s.dim, s.dim) + _layer_norm(s.dim) + s.vocab
    return table, table + dense


def embedding_share(s: Shape) -> float:
    table, total = parameters(s)
    return table / total


def real_parameters(name: str) -> Tuple[int, int]:
    """(token table, all parameters) of the real model ``name`` is shaped after."""
    return parameters(REAL[name][1])


def spread_rows(n_pieces: int, piece_rows: int, seed: int = SPREAD_SEED) -> torch.Tensor:
    """The rows of a small tokenizer's ``n_pieces`` pieces (most frequent first) in a large
    table whose ``piece_rows`` rows after the 4 specials hold sentencepiece pieces.

    A multilingual vocabulary is one sentencepiece model over all its languages, its rows
    sorted by frequency across them: one language's pieces are a sparse subset spread over
    the whole range, in roughly their own frequency order. Which rows a real model gives
    German and English is not known here, so the rows are a seeded uniform sample of the
    piece rows, sorted, the i-th most frequent piece on the i-th smallest sampled row:
    deterministic, in range, one piece per row, frequency order kept (the contiguous shard
    layout still gives low ranks more of the frequent pieces).
    """
    if not 0 <= n_pieces <= piece_rows:
        raise ValueError(f"{n_pieces} pieces do not fit {piece_rows} rows")
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(piece_rows, generator=g)[:n_pieces].sort().values + N_SPECIALS


def _small_pieces(small) -> List[int]:
    """The small dictionary's piece ids (its specials and fairseq's fillers left out)."""
    return [i for i in range(small.nspecial, len(small)) if not small[i].startswith("madeupword")]


def large_dictionary(name: str, small) -> Tuple[Any, torch.Tensor]:
    """The large dictionary of ``name`` (exactly :attr:`VocabLayout.rows` entries) and the
    map small id -> large row (specials to themselves, pieces by :func:`spread_rows`,
    fairseq's fillers of the small dictionary to ``<unk>``)."""
    from fairseq.data import Dictionary

    layout = LAYOUTS[name]
    pieces = _small_pieces(small)
    rows = spread_rows(len(pieces), layout.piece_rows)
    at_row = {int(r): p for r, p in zip(rows, pieces)}
    d = Dictionary()
    for row in range(N_SPECIALS, N_SPECIALS + layout.piece_rows):
        p = at_row.get(row)
        # unused rows are real symbols (another language's pieces, here a filler name)
        d.add_symbol(small[p] if p is not None else f"madeupword{row:06d}", small.count[p] if p is not None else 0)
    for sym in layout.extra:
        d.add_symbol(sym, 0)
    if len(d) != layout.rows:
        raise ValueError(f"{name}: dictionary of {len(d)} entries, expected {layout.rows} (a symbol twice?)")
    to_large = torch.full((len(small),), small.unk(), dtype=torch.long)
    to_large[:small.nspecial] = torch.arange(small.nspecial)
    to_large[torch.tensor(pieces, dtype=torch.long)] = rows
    return d, to_large


# ---------------------------------------------------------------------- cache


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _small_dictionary(data: Path):
    from fairseq.data import Dictionary

    return Dictionary.load(str(data / "deen" / "bin" / "dict.de.txt"))  # the joined dictionary


def cached_dictionary(name: str, data: Path, cache_dir: Path) -> Tuple[Any, torch.Tensor]:
    """:func:`large_dictionary` of ``name``, built once and cached (``dict.txt`` and the row map)."""
    from fairseq.data import Dictionary

    stem = f"{name}_{LAYOUTS[name].rows}"  # another layout is another file
    dict_path, map_path = cache_dir / f"{stem}.dict.txt", cache_dir / f"{stem}.rows.pt"
    if not (dict_path.exists() and map_path.exists()):
        d, to_large = large_dictionary(name, _small_dictionary(data))
        _atomic(map_path, lambda p: torch.save(to_large, p))
        _atomic(dict_path, lambda p: d.save(str(p)))
    d = Dictionary.load(str(dict_path))
    if len(d) != LAYOUTS[name].rows:
        raise ValueError(f"{dict_path} holds {len(d)} entries, expected {LAYOUTS[name].rows}; delete it to rebuild")
    return d, torch.load(map_path)


def _indexed(data: Path, lang: str, small):
    from fairseq.data import data_utils

    d = data / "deen" / "bin"
    ds = data_utils.load_indexed_dataset(str(d / f"train.de-en.{lang}"), small)
    if ds is None:
        raise FileNotFoundError(f"no binarised train split under {d}; run python -m embrace_fairseq.data_prep")
    return ds


def cached_streams(data: Path, cache_dir: Path) -> List[torch.Tensor]:
    """The masked LM's monolingual streams (German, English): every train sentence in
    large-table rows followed by ``</s>``, cached."""
    paths = [cache_dir / f"xlmr_{LAYOUTS['xlmr'].rows}_train_{lang}.pt" for lang in ("de", "en")]
    if not all(p.exists() for p in paths):
        small = _small_dictionary(data)
        _, to_large = cached_dictionary("xlmr", data, cache_dir)
        for lang, path in zip(("de", "en"), paths):
            ds = _indexed(data, lang, small)  # each sentence ends with </s>
            stream = to_large[torch.cat([ds[i] for i in range(len(ds))]).long()]
            _atomic(path, lambda p, s=stream: torch.save(s, p))
    return [torch.load(p) for p in paths]


def prepare(names: Sequence[str], data: Path, cache_dir: Path) -> None:
    """Everything of these workloads the ranks read from the cache."""
    for name in names:
        cached_dictionary(name, data, cache_dir)
    if "xlmr" in names:
        cached_streams(data, cache_dir)


# ---------------------------------------------------------------------- batches


class Blocks:
    """Masked-LM blocks of the language streams: block ``g`` is ``<s>`` and ``size - 1``
    tokens of language ``g % n`` (languages alternate block by block, each stream read on
    from where its previous block ended; the English stream starts half-way so that no
    block sits next to its translation)."""

    def __init__(self, streams: List[torch.Tensor], size: int, bos: int) -> None:
        self.streams, self.size, self.bos = streams, size, bos
        self.starts = [0] + [s.numel() // 2 for s in streams[1:]]

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, g: int) -> torch.Tensor:
        n, span = len(self.streams), self.size - 1
        stream = self.streams[g % n]
        start = (self.starts[g % n] + (g // n) * span) % (stream.numel() - span)
        return torch.cat([torch.tensor([self.bos]), stream[start:start + span]])


def remap_tokens(dataset: Any, to_large: torch.Tensor) -> Any:
    """A fairseq token dataset read through a small id -> large row map (sizes unchanged)."""
    from fairseq.data import BaseWrapperDataset

    class RemapTokens(BaseWrapperDataset):
        def __getitem__(self, i: int) -> torch.Tensor:
            return to_large[self.dataset[i].long()]

    return RemapTokens(dataset)


MASK_PROB, LEAVE_UNMASKED_PROB, RANDOM_TOKEN_PROB = 0.15, 0.1, 0.1
MASK_SEED = 1


def masked_datasets(d: Any, streams: List[torch.Tensor], tokens_per_sample: int) -> Tuple[Any, Any]:
    """(source, target) of fairseq's masking over :class:`Blocks` (target: the chosen
    positions' true tokens, ``<pad>`` elsewhere)."""
    from fairseq.data import MaskTokensDataset

    return MaskTokensDataset.apply_mask(
        Blocks(streams, tokens_per_sample, d.bos()), d, pad_idx=d.pad(), mask_idx=d.index("<mask>"), seed=MASK_SEED,
        mask_prob=MASK_PROB, leave_unmasked_prob=LEAVE_UNMASKED_PROB, random_token_prob=RANDOM_TOKEN_PROB)


def translation_pairs(name: str, d: Any, to_large: torch.Tensor, data: Path) -> Any:
    """The language pairs of ``mbart`` (German -> English, mBART's language ids after
    ``</s>``) or ``m2m`` (both directions, M2M-100's language tokens first)."""
    from fairseq.data import AppendTokenDataset, ConcatDataset, LanguagePairDataset, PrependTokenDataset

    small = _small_dictionary(data)
    de, en = (remap_tokens(_indexed(data, lang, small), to_large) for lang in ("de", "en"))
    if name == "mbart":
        src = AppendTokenDataset(de, d.index("[de_DE]"))
        tgt = AppendTokenDataset(en, d.index("[en_XX]"))
        # the decoder starts from the target language id (translation_from_pretrained_bart's eos)
        return LanguagePairDataset(src, src.sizes, d, tgt, tgt.sizes, d, left_pad_source=True, left_pad_target=False,
                                   eos=d.index("[en_XX]"))
    if name == "m2m":
        tok = {lang: d.index(f"__{lang}__") for lang in ("de", "en")}
        src = ConcatDataset([PrependTokenDataset(de, tok["de"]), PrependTokenDataset(en, tok["en"])])
        tgt = ConcatDataset([PrependTokenDataset(en, tok["en"]), PrependTokenDataset(de, tok["de"])])
        return LanguagePairDataset(src, src.sizes, d, tgt, tgt.sizes, d, left_pad_source=True, left_pad_target=False)
    raise ValueError(f"{name!r} is not a translation workload of this module")


def masked_share(target: torch.Tensor, pad: int) -> float:
    """The share of positions a masked-LM batch computes its loss on."""
    return float(target.ne(pad).sum()) / max(1, target.numel())


def workload_rows(name: str) -> Optional[int]:
    layout = LAYOUTS.get(name)
    return layout.rows if layout is not None else None
