"""Tiny corpora for BART and mBART: a monolingual one for ``--task denoising`` and the two
halves of mBART's path (``multilingual_denoising`` pre-training, ``translation_from_pretrained_bart``
fine-tuning) over one dictionary.

Random tokens as in :mod:`fairseq_corpus`, binarised with fairseq-preprocess's own entry point
(several steps in one process: one import of fairseq). ``--padding-factor 1`` keeps the
dictionary odd: 51 words and 4 specials are 55 rows; denoising adds ``<mask>`` (56 rows),
mBART adds one ``[xx_XX]`` token per language and ``<mask>`` (58 rows with two languages):
shards are uneven on 3 ranks.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

from fairseq_corpus import PathLike, _random_sentences, _run, _write_lines, fairseq_env, fresh_corpus

#: the two languages of the mBART corpus (mBART's own codes)
MBART_LANGS = ("en_XX", "de_DE")

_PREPROCESS = ("import json, sys\nfrom fairseq_cli.preprocess import cli_main\n"
               "for argv in json.loads(sys.stdin.read()):\n    sys.argv = ['fairseq-preprocess', *argv]\n    cli_main()\n")


def _preprocess(steps: List[List[str]], cwd: Path, timeout: float) -> None:
    _run([sys.executable, "-c", _PREPROCESS], cwd=cwd, env=fairseq_env(), timeout=timeout, check=True,
         input_text=json.dumps(steps))


def make_denoising_corpus(
    tmpdir: PathLike, *, n_train: int = 200, n_valid: int = 20, vocab_size: int = 51, min_len: int = 5,
    max_len: int = 20, seed: int = 0, timeout: float = 120,
) -> Path:
    """Monolingual random text for ``--task denoising`` (``dict.txt``, ``train``/``valid``
    splits in ``tmpdir/data-bin``, returned). Documents of three sentences separated by an
    empty line, so ``--sample-break-mode complete_doc`` and ``--permute-sentences`` have
    sentences to permute."""
    tmp, raw, (dest,), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size)
    for split, n in (("train", n_train), ("valid", n_valid)):
        lines = []
        for i, s in enumerate(_random_sentences(rng, n, vocab, min_len, max_len)):
            lines.append(" ".join(s))
            if i % 3 == 2:
                lines.append("")  # end of a document
        (raw / f"{split}.txt").write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
    _preprocess([["--only-source", "--trainpref", str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"),
                  "--destdir", str(dest), "--workers", "1", "--padding-factor", "1"]], tmp, timeout)
    return dest


def make_mbart_corpus(
    tmpdir: PathLike, *, langs: Sequence[str] = MBART_LANGS, n_train: int = 240, n_valid: int = 24,
    n_test: int = 20, vocab_size: int = 51, min_len: int = 3, max_len: int = 12, seed: int = 0,
    timeout: float = 120,
) -> Tuple[Path, Path]:
    """One dictionary, two data folders: ``(pretrain, finetune)``.

    ``pretrain`` is laid out for ``--task multilingual_denoising --langs a,b --add-lang-token``
    (``dict.txt``, ``<lang>/train`` and ``<lang>/valid`` per language); ``finetune`` for
    ``--task translation_from_pretrained_bart --langs a,b -s a -t b`` (``dict.<lang>.txt``,
    ``{split}.a-b.{lang}``; the target is the source mapped word for word and reversed, as
    in :func:`fairseq_corpus.make_translation_corpus`). Both tasks append the same symbols
    to the same ``dict.txt`` (one ``[lang]`` per language, then ``<mask>``), so a checkpoint
    pre-trained on the first fine-tunes on the second, as mBART's published ones do.
    """
    if len(langs) != 2:
        raise ValueError(f"two languages, got {list(langs)}")
    src, tgt = langs
    tmp, raw, (pre, fine), rng, vocab = fresh_corpus(tmpdir, seed, vocab_size, ("pretrain", "finetune"))
    perm = vocab[:]
    rng.shuffle(perm)
    mapping = dict(zip(vocab, perm))
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        sents = _random_sentences(rng, n, vocab, min_len, max_len)
        _write_lines(raw / f"{split}.{src}", sents)
        _write_lines(raw / f"{split}.{tgt}", [[mapping[w] for w in reversed(s)] for s in sents])
    common = ["--workers", "1", "--padding-factor", "1"]
    dictionary = fine / f"dict.{src}.txt"
    steps = [["--source-lang", src, "--target-lang", tgt, "--trainpref", str(raw / "train"),
              "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"), "--destdir", str(fine),
              "--joined-dictionary", *common]]
    for lang in langs:  # each language's text alone, binarised with the joined dictionary
        steps.append(["--only-source", "--trainpref", str(raw / f"train.{lang}"),
                      "--validpref", str(raw / f"valid.{lang}"), "--destdir", str(pre / lang),
                      "--srcdict", str(dictionary), *common])
    _preprocess(steps, tmp, timeout)
    shutil.copy(dictionary, pre / "dict.txt")
    return pre, fine
