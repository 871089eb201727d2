"""The benchmark's models and their batches, built with fairseq from the prepared data.

* ``translation``: the main job's Transformer (2+2 layers, d=256, ffn 512, 4 heads,
  all embeddings tied, joint 8k sentencepiece vocabulary) on the German-English
  LibreOffice help (``data/deen/bin``), batched by fairseq's ``batch_by_size``.
* ``lm``: a Transformer LM over a word-level dictionary of the whole State of the Union
  text (every whitespace token of train, valid and test: 66k types), trained on the
  train split in blocks of ``tokens_per_sample``. Input embedding untied from an
  adaptive softmax output, so the input table dominates the parameters, as in the
  large-vocabulary LMs EmbRace targets (a tied output would move the full table in
  every strategy). Named "untied LM" in the reports.
* ``gpt_lm``: a GPT-style Transformer LM as fairseq users build one: input and output
  tables tied (``--share-decoder-input-output-embed``), full softmax, over a 32k
  sentencepiece BPE vocabulary trained on the same English train split (every piece of
  the model in the dictionary, sorted by frequency as ``fairseq-preprocess`` sorts).

Both strategies of a pair (stock / EmbRace) are built from the same fairseq arguments
with the same seed; batch ``(step, rank)`` is a pure function of the workload and the
world size, so every strategy trains on the same data.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Workload:
    name: str  # "translation" | "lm" | "gpt_lm"
    stock_arch: str
    embrace_arch: str
    model_args: Tuple[str, ...]
    task_args: Tuple[str, ...]
    tokens_per_rank: int  # translation: fairseq --max-tokens; lm: blocks x tokens_per_sample
    tokens_per_sample: int = 0
    criterion: str = "cross_entropy"

    @property
    def is_translation(self) -> bool:
        return "translation" in self.task_args

    @property
    def tables(self) -> Tuple[str, ...]:
        """The token tables' parameter names, the encoder's first: one when the model shares
        a table between its lookups (an LM, ``--share-all-embeddings``), else the encoder's
        and the decoder's (each its own exchange)."""
        if not self.is_translation:
            return ("decoder.embed_tokens.weight",)
        if "--share-all-embeddings" in self.model_args:
            return ("encoder.embed_tokens.weight",)
        return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


TRANSLATION_MODEL = (
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings", "--dropout", "0.0",
)


# fairseq's transformer_iwslt_de_en (6+6 layers, d=512, ffn 1024, 4 heads) with its decoder
# table tied to the output projection, as its IWSLT'14 recipe trains it; the encoder
# keeps a table of its own (two exchanges per step)
IWSLT_MODEL = ("--share-decoder-input-output-embed", "--dropout", "0.0")
IWSLT_TOKENS = 256  # per rank: the 6+6-layer model at 8 ranks on a few cores must fit the run

GPT_BPE_VOCAB = 32000  # sentencepiece pieces of the GPT-style LM's vocabulary
LM_SAMPLE = 128  # tokens per sample of both LMs


def workloads(quick: bool) -> Dict[str, Workload]:
    """The models; quick mode keeps the translation model and shrinks the LMs and the batches."""
    lm_dim = 96 if quick else 192
    lm_layers = 1 if quick else 2
    decoder = ("--decoder-layers", str(lm_layers), "--decoder-embed-dim", str(lm_dim),
               "--decoder-input-dim", str(lm_dim), "--decoder-output-dim", str(lm_dim),
               "--decoder-ffn-embed-dim", str(4 * lm_dim), "--decoder-attention-heads", "4", "--dropout", "0.0")
    return {
        "translation": Workload(
            "translation", "transformer", "embrace_transformer", TRANSLATION_MODEL,
            ("--task", "translation", "--source-lang", "de", "--target-lang", "en"),
            tokens_per_rank=384 if quick else 512,
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
            "gpt_lm", "transformer_lm", "embrace_transformer_lm",
            (*decoder, "--share-decoder-input-output-embed"),
            ("--task", "language_modeling"),
            tokens_per_rank=4 * LM_SAMPLE, tokens_per_sample=LM_SAMPLE,
        ),
    }


def tied_output(w: Workload) -> bool:
    """Does the output projection read a token table (tied embeddings)?"""
    return any(f in w.model_args for f in ("--share-all-embeddings", "--share-decoder-input-output-embed"))


def tied_tables(w: Workload) -> List[bool]:
    """Per token table (:attr:`Workload.tables` order): does the output projection read it?
    Only the last one can be (the decoder's, or the one table all lookups share)."""
    n = len(w.tables)
    return [tied_output(w) and i == n - 1 for i in range(n)]


# ---------------------------------------------------------------------- fairseq arguments, task, model


def fairseq_args(w: Workload, arch: str, data: Path) -> Any:
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers embrace_* archs, CPU fixes)
    from fairseq import options

    data_dir = data / ("deen/bin" if w.is_translation else "lm/bin")
    argv = [str(data_dir), *w.task_args, "--arch", arch, *w.model_args, "--cpu", "--seed", "1",
            "--criterion", w.criterion]
    if w.tokens_per_sample:
        argv += ["--tokens-per-sample", str(w.tokens_per_sample)]
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

    def get(self, step: int, rank: int) -> Dict[str, Any]:
        w = self.workload
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
        """Target tokens of the batch (the positions its loss is computed on)."""
        return int(self.get(step, rank)["ntokens"])

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
    if w.is_translation:
        from fairseq.data import Dictionary, LanguagePairDataset, data_utils

        d = data / "deen" / "bin"
        src_dict, tgt_dict = Dictionary.load(str(d / "dict.de.txt")), Dictionary.load(str(d / "dict.en.txt"))
        src = data_utils.load_indexed_dataset(str(d / "train.de-en.de"), src_dict)
        tgt = data_utils.load_indexed_dataset(str(d / "train.de-en.en"), tgt_dict)
        if src is None or tgt is None:
            raise FileNotFoundError(f"no binarised train split under {d}; run python -m embrace_fairseq.data_prep")
        pairs = LanguagePairDataset(src, src.sizes, src_dict, tgt, tgt.sizes, tgt_dict,
                                    left_pad_source=True, left_pad_target=False)
        # fairseq's batching: sort by length, pack to --max-tokens, shuffle the batches
        with data_utils.numpy_seed(1):
            order = pairs.ordered_indices()
        batches = [list(b) for b in pairs.batch_by_size(order, max_tokens=w.tokens_per_rank)]
        g = torch.Generator().manual_seed(1)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        task = BenchTask(source_dictionary=src_dict, target_dictionary=tgt_dict)
        return Batches(w, world_size, task, _pairs=pairs, _batches=batches)
    if w.name == "gpt_lm":
        dictionary, stream = bpe_corpus(data, cache_dir)
    else:
        dictionary = lm_dictionary(data, cache_dir)
        stream = lm_stream(data, cache_dir, dictionary)
    task = BenchTask(source_dictionary=dictionary, target_dictionary=dictionary)
    return Batches(w, world_size, task, _stream=stream)


def build_model(w: Workload, arch: str, task: Any, data: Path, seed: int = 1) -> torch.nn.Module:
    """A fairseq model (stock or EmbRace arch) with the workload's arguments and seed."""
    from fairseq import models
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    # as fairseq-train does: arguments -> config -> models.build_model
    cfg = convert_namespace_to_omegaconf(fairseq_args(w, arch, data))
    torch.manual_seed(seed)
    return models.build_model(cfg.model, task)


def build_criterion(w: Workload, task: Any):
    if w.criterion == "adaptive_loss":
        from fairseq.criterions.adaptive_loss import AdaptiveLoss

        return AdaptiveLoss(task, sentence_avg=False)
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    return CrossEntropyCriterion(task, sentence_avg=False)


def token_table_name(w: Workload) -> str:
    """The first token table (the only one unless the encoder and decoder have their own)."""
    return w.tables[0]


def dense_layers(model: torch.nn.Module, w: Workload) -> List[Dict[str, Any]]:
    """Replicated parameters grouped by layer, in registration (= forward) order."""
    groups: "collections.OrderedDict[str, int]" = collections.OrderedDict()
    for name, p in model.named_parameters():
        if name in w.tables:
            continue
        parts = name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ".".join(parts[:-1])
        groups[key] = groups.get(key, 0) + p.numel()
    return [{"name": k, "numel": int(v)} for k, v in groups.items()]
