"""The benchmark's models and their batches, built with fairseq from the prepared data.

* ``translation``: shaped after Transformer base (WMT'16 en-de; :mod:`.shapes`): its
  32,768-row joint table shared by both sides and the output (``--share-all-embeddings``),
  its embedding share (27.5 %) from a feed-forward width solved for it, 2+2 layers of d 64;
  the German-English LibreOffice help (``data/deen/bin``, a joint 8k sentencepiece
  vocabulary on the table's first rows, the rest filler rows as fairseq pads a dictionary),
  batched by fairseq's ``batch_by_size``.
* ``gpt_lm``: shaped after GPT-2 small: input and output tables tied
  (``--share-decoder-input-output-embed``), full softmax, its 50,257 rows (a 32k
  sentencepiece BPE trained on the English train split on the first rows, sorted by
  frequency as ``fairseq-preprocess`` sorts, filler rows after them) and its embedding
  share (31.0 %), 2 layers of d 64.
* ``lm`` (synthetic: it stands for no released model, :data:`.shapes.SYNTHETIC`): a
  Transformer LM over a word-level dictionary of the whole State of the Union text (every
  whitespace token of train, valid and test: 66k types), trained on the train split in
  blocks of ``tokens_per_sample``. Input embedding untied from an adaptive softmax output,
  so the input table dominates the parameters. Named "untied LM" in the reports.
* ``xlmr``, ``mbart``, ``m2m``: large vocabularies shaped after XLM-R base (masked LM,
  250,002 rows), mBART-large (translation, 250,027 rows, one table) and M2M-100 418M
  (multilingual translation, 128,112 rows, one table): their row counts, tokens per rank,
  masked share and embedding share of the parameters kept, width and depth small
  (:mod:`.large_vocab` says where each number comes from; :func:`workload_shape` reports them).

Both strategies of a pair (stock / EmbRace) are built from the same fairseq arguments
with the same seed; batch ``(step, rank)`` is a pure function of the workload and the
world size, so every strategy trains on the same data.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from embrace_fairseq.perf.bench import large_vocab as LV
from embrace_fairseq.perf.bench import shapes as SH

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Workload:
    name: str  # "translation" | "lm" | "gpt_lm" | "iwslt" | "xlmr" | "mbart" | "m2m"
    stock_arch: str
    embrace_arch: str
    model_args: Tuple[str, ...]
    task_args: Tuple[str, ...]
    tokens_per_rank: int  # translation: fairseq --max-tokens; lm: blocks x tokens_per_sample
    tokens_per_sample: int = 0
    criterion: str = "cross_entropy"
    #: rows of the token table: the dictionary padded with filler rows to the released
    #: model's row count (0: the data's dictionary as it is)
    vocab_rows: int = 0

    @property
    def is_translation(self) -> bool:
        return "translation" in self.task_args

    @property
    def is_masked_lm(self) -> bool:
        return "masked_lm" in self.task_args

    @property
    def ties_output(self) -> bool:
        """Whether an output layer reads the token table (what ``--embrace-output`` rules):
        RoBERTa's LM head, a shared decoder input/output or all-shared embeddings; not an
        untied output or an adaptive softmax."""
        return self.is_masked_lm or any(flag in self.model_args for flag in
                                        ("--share-all-embeddings", "--share-decoder-input-output-embed"))

    @property
    def tables(self) -> Tuple[str, ...]:
        """The token tables' parameter names, the encoder's first: one when the model shares
        a table between its lookups (an LM, ``--share-all-embeddings``), else the encoder's
        and the decoder's (each its own exchange)."""
        if self.is_masked_lm:  # RoBERTa: the encoder's table, read again by the LM head
            return ("encoder.sentence_encoder.embed_tokens.weight",)
        if not self.is_translation:
            return ("decoder.embed_tokens.weight",)
        if "--share-all-embeddings" in self.model_args:
            return ("encoder.embed_tokens.weight",)
        return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


#: the named small workloads' width and depth; the feed-forward width sets the embedding
#: share to the real model's (:func:`.shapes.ffn_for_share`)
NAMED_DIM, NAMED_HEADS, NAMED_LAYERS = 64, 4, 2
TRANSLATION_ROWS = SH.REAL["translation"].shape.vocab
GPT_ROWS = SH.REAL["gpt_lm"].shape.vocab


def translation_dims():
    """The translation workload's :class:`~.large_vocab.Shape` (post-norm, sinusoidal,
    one table): Transformer base's rows and share at the bench's width."""
    base = LV.Shape(TRANSLATION_ROWS, NAMED_DIM, NAMED_LAYERS, NAMED_LAYERS, 0)
    return replace(base, ffn=SH.ffn_for_share(base, SH.REAL["translation"].embedding_share))


def gpt_dims():
    """The GPT-style LM's :class:`~.large_vocab.Shape` (a decoder without cross-attention
    counts as an encoder stack; sinusoidal positions, no final norm, as fairseq's
    ``transformer_lm`` builds it): GPT-2 small's rows and share at the bench's width."""
    base = LV.Shape(GPT_ROWS, NAMED_DIM, NAMED_LAYERS, 0, 0)
    return replace(base, ffn=SH.ffn_for_share(base, SH.REAL["gpt_lm"].embedding_share))


def _translation_model() -> Tuple[str, ...]:
    s = translation_dims()
    return ("--encoder-layers", str(s.encoder_layers), "--decoder-layers", str(s.decoder_layers),
            "--encoder-embed-dim", str(s.dim), "--decoder-embed-dim", str(s.dim),
            "--encoder-ffn-embed-dim", str(s.ffn), "--decoder-ffn-embed-dim", str(s.ffn),
            "--encoder-attention-heads", str(NAMED_HEADS), "--decoder-attention-heads", str(NAMED_HEADS),
            "--share-all-embeddings", "--dropout", "0.0")


def _gpt_model() -> Tuple[str, ...]:
    s = gpt_dims()
    return ("--decoder-layers", str(s.encoder_layers), "--decoder-embed-dim", str(s.dim),
            "--decoder-input-dim", str(s.dim), "--decoder-output-dim", str(s.dim),
            "--decoder-ffn-embed-dim", str(s.ffn), "--decoder-attention-heads", str(NAMED_HEADS),
            "--dropout", "0.0", "--share-decoder-input-output-embed")

# fairseq's transformer_iwslt_de_en (6+6 layers, d=512, ffn 1024, 4 heads) with its decoder
# table tied to the output projection, as its IWSLT'14 recipe trains it; the encoder
# keeps a table of its own (two exchanges per step)
IWSLT_MODEL = ("--share-decoder-input-output-embed", "--dropout", "0.0")
IWSLT_TOKENS = 256  # per rank: the 6+6-layer model at 8 ranks on a few cores must fit the run

GPT_BPE_VOCAB = 32000  # sentencepiece pieces of the GPT-style LM's vocabulary
LM_SAMPLE = 128  # tokens per sample of both LMs


#: the large-vocabulary workloads' width: d 16 with two heads and 2 layers per stack; the
#: feed-forward width sets the embedding share to the real model's (:mod:`.large_vocab`)
LARGE_DIM, LARGE_HEADS, LARGE_LAYERS = 16, 2, 2
LARGE_FFN = {"xlmr": 23296, "mbart": 41728, "m2m": 41728}
NO_DROPOUT = ("--dropout", "0.0", "--attention-dropout", "0.0", "--activation-dropout", "0.0")
XLMR_SAMPLE = 512  # tokens per sequence, <s> included
XLMR_TOKENS = 16 * XLMR_SAMPLE  # per rank: 8192 sequences of 512 tokens on 500 GPUs
SEQ2SEQ_TOKENS = 1024  # per rank: --max-tokens of the released mBART and multilingual recipes


def _stack(side: str, ffn: int) -> Tuple[str, ...]:
    return (f"--{side}-layers", str(LARGE_LAYERS), f"--{side}-embed-dim", str(LARGE_DIM),
            f"--{side}-ffn-embed-dim", str(ffn), f"--{side}-attention-heads", str(LARGE_HEADS))


def large_vocab_workloads() -> Dict[str, Workload]:
    """The three large-vocabulary workloads (the same in quick mode: their token counts are the point)."""
    pair = ("--task", "translation", "--source-lang", "de", "--target-lang", "en")
    return {
        "xlmr": Workload(
            "xlmr", "roberta", "embrace_roberta",
            (*_stack("encoder", LARGE_FFN["xlmr"]), "--max-positions", str(XLMR_SAMPLE), *NO_DROPOUT,
             "--pooler-dropout", "0.0"),
            ("--task", "masked_lm"), tokens_per_rank=XLMR_TOKENS, tokens_per_sample=XLMR_SAMPLE, criterion="masked_lm",
        ),
        "mbart": Workload(
            "mbart", "mbart_large", "embrace_mbart_large",
            (*_stack("encoder", LARGE_FFN["mbart"]), *_stack("decoder", LARGE_FFN["mbart"]), "--share-all-embeddings",
             # as the released recipe trains mbart_large (its checkpoint is pre-norm)
             "--encoder-normalize-before", "--decoder-normalize-before", "--layernorm-embedding", *NO_DROPOUT),
            pair, tokens_per_rank=SEQ2SEQ_TOKENS,
        ),
        "m2m": Workload(
            "m2m", "transformer", "embrace_transformer",
            (*_stack("encoder", LARGE_FFN["m2m"]), *_stack("decoder", LARGE_FFN["m2m"]), "--share-all-embeddings",
             "--encoder-normalize-before", "--decoder-normalize-before", "--activation-fn", "relu", *NO_DROPOUT),
            pair, tokens_per_rank=SEQ2SEQ_TOKENS,
        ),
    }


LARGE_VOCAB = tuple(large_vocab_workloads())


def workloads(quick: bool) -> Dict[str, Workload]:
    """The models; quick mode shrinks the synthetic LM and the translation batches (the
    named workloads keep their shapes)."""
    lm_dim = 96 if quick else 192
    lm_layers = 1 if quick else 2
    decoder = ("--decoder-layers", str(lm_layers), "--decoder-embed-dim", str(lm_dim),
               "--decoder-input-dim", str(lm_dim), "--decoder-output-dim", str(lm_dim),
               "--decoder-ffn-embed-dim", str(4 * lm_dim), "--decoder-attention-heads", "4", "--dropout", "0.0")
    return {
        "translation": Workload(
            "translation", "transformer", "embrace_transformer", _translation_model(),
            ("--task", "translation", "--source-lang", "de", "--target-lang", "en"),
            tokens_per_rank=384 if quick else 512, vocab_rows=TRANSLATION_ROWS,
        ),
        "lm": Workload(
            "lm", "transformer_lm", "embrace_transformer_lm",
            (*decoder, "--adaptive-softmax-cutoff", "5000,20000", "--adaptive-softmax-factor", "4",
             "--adaptive-softmax-dropout", "0.0"),
            ("--task", "language_modeling"),
            tokens_per_rank=4 * LM_SAMPLE, tokens_per_sample=LM_SAMPLE, criterion="adaptive_loss",
        ),
        "iwslt": Workload(
            "iwslt", "transformer_iwslt_de_en", "embrace_transformer_iwslt_de_en", IWSLT_MODEL,
            ("--task", "translation", "--source-lang", "de", "--target-lang", "en"),
            tokens_per_rank=128 if quick else IWSLT_TOKENS,
        ),
        "gpt_lm": Workload(
            "gpt_lm", "transformer_lm", "embrace_transformer_lm", _gpt_model(),
            ("--task", "language_modeling"),
            tokens_per_rank=4 * LM_SAMPLE, tokens_per_sample=LM_SAMPLE, vocab_rows=GPT_ROWS,
        ),
        **large_vocab_workloads(),
    }


def workload_shape(name: str) -> Dict[str, Any]:
    """What a workload is shaped after, and how close it stays (pure: no model is built).

    For a workload named after a released model (:data:`.shapes.REAL`): the real model's
    name, vocabulary, parameters and embedding share (from its published dims), the
    workload's own rows, parameters and share (from its dims, by the same count), the gap in
    points, tokens per rank (and, where fewer than the published training's, why; for
    translation the ``--max-tokens`` bound, which fairseq's batches fill up to with padding)
    and the masked share (the share of positions the loss reads: 0.15 for the masked LM,
    None elsewhere). A synthetic workload says why it stands for no released model.
    """
    w = workloads(quick=False).get(name)
    if w is None:
        raise KeyError(f"unknown workload {name!r}; expected one of {', '.join(workloads(quick=False))}")
    out: Dict[str, Any] = {"name": name, "objective": w.criterion, "masked_share": None}
    out.update(SH.describe(name, workload_dims(w) if name in SH.REAL else None, w.tokens_per_rank))
    if name in LV.REAL:
        out.update(masked_share=LV.MASK_PROB if w.is_masked_lm else None,
                   objective={"xlmr": "masked LM", "mbart": "translation de->en",
                              "m2m": "multilingual translation de<->en"}[name])
    elif name in SH.REAL:
        out["objective"] = {"translation": "translation de->en", "gpt_lm": "causal LM"}[name]
    return out


def workload_dims(w: Workload) -> "LV.Shape":
    """A named workload's :class:`~.large_vocab.Shape` (the real model's structure with the
    workload's width and depth)."""
    if w.name == "translation":
        return translation_dims()
    if w.name == "gpt_lm":
        return gpt_dims()
    real = LV.REAL[w.name][1]
    ffn = LARGE_FFN[w.name]
    return LV.Shape(LV.LAYOUTS[w.name].rows, LARGE_DIM, LARGE_LAYERS, LARGE_LAYERS if real.decoder_layers else 0, ffn,
                    learned_positions={"xlmr": XLMR_SAMPLE + 2, "mbart": 1026, "m2m": 0}[w.name],
                    layernorm_embedding=real.layernorm_embedding, final_layer_norm=real.final_layer_norm,
                    lm_head=real.lm_head)


def pad_rows(dictionary: Any, rows: int) -> Any:
    """``dictionary`` with filler symbols (``madeupword``, as fairseq pads a dictionary) after
    its own up to ``rows`` rows: the released model's table size, the data's symbols keeping
    their ids. Returns it; a dictionary already larger is an error."""
    if rows and len(dictionary) > rows:
        raise ValueError(f"the dictionary has {len(dictionary)} rows, more than the {rows} to pad it to")
    i = 0
    while rows and len(dictionary) < rows:
        dictionary.add_symbol(f"madeupword{i:06d}", n=0)
        i += 1
    return dictionary


def tied_output(w: Workload) -> bool:
    """Does the output projection read a token table (tied embeddings)?"""
    if w.is_masked_lm:  # RoBERTa's LM head reads the table unless told not to
        return "--untie-weights-roberta" not in w.model_args
    return any(f in w.model_args for f in ("--share-all-embeddings", "--share-decoder-input-output-embed"))


def tied_tables(w: Workload) -> List[bool]:
    """Per token table (:attr:`Workload.tables` order): does the output projection read it?
    Only the last one can be (the decoder's, or the one table all lookups share)."""
    n = len(w.tables)
    return [tied_output(w) and i == n - 1 for i in range(n)]


# ---------------------------------------------------------------------- fairseq arguments, task, model


def fairseq_args(w: Workload, arch: str, data: Path, extra_args: Sequence[str] = ()) -> Any:
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers embrace_* archs, CPU fixes)
    from fairseq import options

    data_dir = data / ("deen/bin" if w.is_translation else "lm/bin")
    argv = [str(data_dir), *w.task_args, "--arch", arch, *w.model_args, "--cpu", "--seed", "1",
            "--criterion", w.criterion]
    if w.tokens_per_sample:
        argv += ["--tokens-per-sample", str(w.tokens_per_sample)]
    if arch.startswith("embrace_"):  # the fixed EmbRace strategies shard every table (not the auto plan)
        argv += ["--embrace-plan", "shard"]
    argv += list(extra_args)  # a strategy's own flags, last so that they win (e.g. --embrace-output gather)
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=argv)


class BenchTask(SimpleNamespace):
    """What ``build_model`` and the criterions read from a fairseq task."""


def lm_dictionary(data: Path, cache_dir: Path):
    """Word-level fairseq Dictionary over all SOTU text (cached as a dict.txt)."""
    from fairseq.data import Dictionary

    path = cache_dir / "sotu_words.dict.txt"
    if path.exists():
        return Dictionary.load(str(path))
    counts: collections.Counter = collections.Counter()
    for split in ("train", "valid", "test"):
        with open(data / "lm" / "raw" / f"{split}.txt", encoding="utf-8") as f:
            for line in f:
                counts.update(line.split())
    d = Dictionary()
    for word, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        d.add_symbol(word, n)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    d.save(str(tmp))
    os.replace(tmp, path)
    return d


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def bpe_model(data: Path, cache_dir: Path) -> Path:
    """The GPT-style LM's sentencepiece BPE model (:data:`GPT_BPE_VOCAB` pieces), trained
    once on the English train split and cached."""
    from embrace_fairseq.data_prep.spm import train_spm

    path = cache_dir / f"sotu_bpe{GPT_BPE_VOCAB}.model"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f"sotu_bpe{GPT_BPE_VOCAB}.{os.getpid()}.model"
        train_spm([data / "lm" / "raw" / "train.txt"], tmp, GPT_BPE_VOCAB, model_type="bpe")
        os.replace(tmp, path)
        tmp.with_suffix(".vocab").unlink(missing_ok=True)
    return path


def bpe_corpus(data: Path, cache_dir: Path) -> Tuple[Any, torch.Tensor]:
    """(fairseq Dictionary, train stream of its ids with one eos per line) of the BPE
    model: every piece in the dictionary (the unseen ones with count 0), sorted by their
    count over all SOTU text as fairseq-preprocess sorts; cached."""
    import sentencepiece as spm
    from fairseq.data import Dictionary

    dict_path = cache_dir / f"sotu_bpe{GPT_BPE_VOCAB}.dict.txt"
    stream_path = cache_dir / f"sotu_bpe{GPT_BPE_VOCAB}_train.pt"
    if dict_path.exists() and stream_path.exists():
        return Dictionary.load(str(dict_path)), torch.load(stream_path)
    proc = spm.SentencePieceProcessor(model_file=str(bpe_model(data, cache_dir)))
    encoded: Dict[str, List[List[int]]] = {}
    for split in ("train", "valid", "test"):
        with open(data / "lm" / "raw" / f"{split}.txt", encoding="utf-8") as f:
            encoded[split] = proc.encode([line.rstrip("\n") for line in f])
    counts = collections.Counter(i for lines in encoded.values() for line in lines for i in line)
    pieces = [proc.id_to_piece(i) for i in range(proc.get_piece_size())]
    d = Dictionary()
    for i in sorted(range(len(pieces)), key=lambda i: (-counts[i], pieces[i])):
        if not proc.is_control(i):
            d.add_symbol(pieces[i], counts[i])
    to_dict = torch.tensor([d.index(p) for p in pieces], dtype=torch.long)
    ids: List[int] = []
    for line in encoded["train"]:
        ids.extend(line)
        ids.append(-1)
    t = torch.tensor(ids, dtype=torch.long)
    eos = t.eq(-1)
    stream = torch.where(eos, torch.full_like(t, d.eos()), to_dict[t.clamp(min=0)])
    tmp = dict_path.with_suffix(f".{os.getpid()}.tmp")
    d.save(str(tmp))
    os.replace(tmp, dict_path)
    _save_atomic(stream, stream_path)
    return d, stream


def prepare_shared_inputs(models: List[str], data: Path, cache_dir: Path) -> None:
    """Build the cached dictionaries and streams once, before the ranks start."""
    if "lm" in models:
        lm_stream(data, cache_dir, lm_dictionary(data, cache_dir))
    if "gpt_lm" in models:
        bpe_corpus(data, cache_dir)
    LV.prepare([m for m in models if m in LARGE_VOCAB], data, cache_dir)


def lm_stream(data: Path, cache_dir: Path, dictionary) -> torch.Tensor:
    """The train split as word ids (one eos per line), cached next to the dictionary."""
    path = cache_dir / "sotu_train_words.pt"
    if path.exists():
        return torch.load(path)
    ids: List[int] = []
    with open(data / "lm" / "raw" / "train.txt", encoding="utf-8") as f:
        for line in f:
            ids.extend(dictionary.index(w) for w in line.split())
            ids.append(dictionary.eos())
    t = torch.tensor(ids, dtype=torch.long)
    _save_atomic(t, path)
    return t


@dataclass
class Batches:
    """Batch ``(step, rank)`` of a workload for a world size."""

    workload: Workload
    world_size: int
    task: Any
    _pairs: Any = None  # translation: LanguagePairDataset
    _batches: List[List[int]] = field(default_factory=list)
    _stream: Optional[torch.Tensor] = None
    _masked: Any = None  # masked LM: (source, target) datasets of fairseq's masking, by block

    def get(self, step: int, rank: int) -> Dict[str, Any]:
        w = self.workload
        if w.is_masked_lm:
            n = w.tokens_per_rank // w.tokens_per_sample
            blocks = range((step * self.world_size + rank) * n, (step * self.world_size + rank + 1) * n)
            src = torch.stack([self._masked[0][g] for g in blocks])
            return {"id": torch.arange(n), "nsentences": n, "ntokens": int(src.numel()),
                    "net_input": {"src_tokens": src, "src_lengths": torch.full((n,), w.tokens_per_sample)},
                    "target": torch.stack([self._masked[1][g] for g in blocks])}
        if w.is_translation:
            idx = self._batches[(step * self.world_size + rank) % len(self._batches)]
            return self._pairs.collater([self._pairs[i] for i in idx])
        n_blocks = w.tokens_per_rank // w.tokens_per_sample
        span = w.tokens_per_sample + 1
        start = (step * self.world_size + rank) * n_blocks * span
        start %= max(1, self._stream.numel() - n_blocks * span)
        blocks = self._stream[start:start + n_blocks * span].view(n_blocks, span)
        src, tgt = blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous()
        return {"id": torch.arange(n_blocks), "nsentences": n_blocks, "ntokens": int(tgt.numel()),
                "net_input": {"src_tokens": src, "src_lengths": torch.full((n_blocks,), w.tokens_per_sample)},
                "target": tgt}

    def target_tokens(self, step: int, rank: int) -> int:
        """Target tokens of the batch (the positions its loss is computed on: a masked LM's
        masked positions)."""
        b = self.get(step, rank)
        if self.workload.is_masked_lm:
            return int(b["target"].ne(self.task.target_dictionary.pad()).sum())
        return int(b["ntokens"])

    def table_ids(self, step: int, rank: int) -> List[torch.Tensor]:
        """Per token table (:attr:`Workload.tables` order) every id the batch looks up in it
        (one exchange per table and step)."""
        b = self.get(step, rank)
        parts = [b["net_input"]["src_tokens"].reshape(-1)]
        if "prev_output_tokens" in b["net_input"]:
            parts.append(b["net_input"]["prev_output_tokens"].reshape(-1))
        return parts if len(self.workload.tables) == len(parts) else [torch.cat(parts)]

    def ids(self, step: int, rank: int) -> torch.Tensor:
        """Every id the batch looks up, over all tables: the decoder table's shifted past the
        encoder's when they are two (one id space of all rows, for id statistics)."""
        parts = self.table_ids(step, rank)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([parts[0], parts[1] + len(self.task.source_dictionary)])


def build_task_and_batches(w: Workload, world_size: int, data: Path, cache_dir: Path) -> Batches:
    """Dictionaries (the fairseq task stand-in) and the batch source."""
    if w.name in LARGE_VOCAB:
        return _large_vocab_batches(w, world_size, data, cache_dir)
    if w.is_translation:
        from fairseq.data import Dictionary, LanguagePairDataset, data_utils

        d = data / "deen" / "bin"
        src_dict = pad_rows(Dictionary.load(str(d / "dict.de.txt")), w.vocab_rows)
        tgt_dict = pad_rows(Dictionary.load(str(d / "dict.en.txt")), w.vocab_rows)
        src = data_utils.load_indexed_dataset(str(d / "train.de-en.de"), src_dict)
        tgt = data_utils.load_indexed_dataset(str(d / "train.de-en.en"), tgt_dict)
        if src is None or tgt is None:
            raise FileNotFoundError(f"no binarised train split under {d}; run python -m embrace_fairseq.data_prep")
        pairs = LanguagePairDataset(src, src.sizes, src_dict, tgt, tgt.sizes, tgt_dict,
                                    left_pad_source=True, left_pad_target=False)
        task = BenchTask(source_dictionary=src_dict, target_dictionary=tgt_dict)
        return Batches(w, world_size, task, _pairs=pairs, _batches=_pair_batches(pairs, w.tokens_per_rank))
    if w.name == "gpt_lm":
        dictionary, stream = bpe_corpus(data, cache_dir)
    else:
        dictionary = lm_dictionary(data, cache_dir)
        stream = lm_stream(data, cache_dir, dictionary)
    dictionary = pad_rows(dictionary, w.vocab_rows)
    task = BenchTask(source_dictionary=dictionary, target_dictionary=dictionary)
    return Batches(w, world_size, task, _stream=stream)


def _pair_batches(pairs: Any, max_tokens: int) -> List[List[int]]:
    """fairseq's batching: sort by length, pack to --max-tokens, shuffle the batches."""
    from fairseq.data import data_utils

    with data_utils.numpy_seed(1):
        order = pairs.ordered_indices()
    batches = [list(b) for b in pairs.batch_by_size(order, max_tokens=max_tokens)]
    g = torch.Generator().manual_seed(1)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def _large_vocab_batches(w: Workload, world_size: int, data: Path, cache_dir: Path) -> Batches:
    d, to_large = LV.cached_dictionary(w.name, data, cache_dir)
    # the masked-LM task and BART's read the dictionary under these names too
    task = BenchTask(source_dictionary=d, target_dictionary=d, dictionary=d)
    if w.is_masked_lm:
        masked = LV.masked_datasets(d, LV.cached_streams(data, cache_dir), w.tokens_per_sample)
        return Batches(w, world_size, task, _masked=masked)
    pairs = LV.translation_pairs(w.name, d, to_large, data)
    return Batches(w, world_size, task, _pairs=pairs, _batches=_pair_batches(pairs, w.tokens_per_rank))


def build_model(w: Workload, arch: str, task: Any, data: Path, seed: int = 1,
                extra_args: Sequence[str] = ()) -> torch.nn.Module:
    """A fairseq model (stock or EmbRace arch) with the workload's arguments and seed, and
    ``extra_args`` (command-line flags) after them."""
    from fairseq import models
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    # as fairseq-train does: arguments -> config -> models.build_model
    cfg = convert_namespace_to_omegaconf(fairseq_args(w, arch, data, extra_args))
    torch.manual_seed(seed)
    return models.build_model(cfg.model, task)


def fairseq_criterion(name: str, task: Any):
    """fairseq's criterion ``name`` (``"masked_lm"``, ``"adaptive_loss"``, else cross
    entropy) over ``task``, token-averaged as fairseq-train builds it by default."""
    if name == "masked_lm":
        from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss

        return MaskedLmLoss(MaskedLmConfig(tpu=False), task)
    if name == "adaptive_loss":
        from fairseq.criterions.adaptive_loss import AdaptiveLoss

        return AdaptiveLoss(task, sentence_avg=False)
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    return CrossEntropyCriterion(task, sentence_avg=False)


def build_criterion(w: Workload, task: Any):
    return fairseq_criterion(w.criterion, task)


def token_table_name(w: Workload) -> str:
    """The first token table (the only one unless the encoder and decoder have their own)."""
    return w.tables[0]


def token_table_module(model: torch.nn.Module, w: Workload) -> torch.nn.Module:
    """The embedding module of the first token table (the one a sparse variant swaps)."""
    return model.get_submodule(token_table_name(w).rsplit(".", 1)[0])


def dense_layers(model: torch.nn.Module, w: Workload) -> List[Dict[str, Any]]:
    """Replicated parameters grouped by layer (``<stack>.layers.<i>``, e.g. RoBERTa's
    ``encoder.sentence_encoder.layers.0``), else by module, in registration (= forward) order."""
    groups: "collections.OrderedDict[str, int]" = collections.OrderedDict()
    for name, p in model.named_parameters():
        if name in w.tables:
            continue
        parts = name.split(".")
        at = parts.index("layers") if "layers" in parts[:-2] else -1
        key = ".".join(parts[:at + 2]) if at >= 0 else ".".join(parts[:-1])
        groups[key] = groups.get(key, 0) + p.numel()
    return [{"name": k, "numel": int(v)} for k, v in groups.items()]
