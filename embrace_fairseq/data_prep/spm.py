"""Sentencepiece training and encoding, made byte-for-byte reproducible.

Determinism: the trainer reads sentences from an iterator in file order (no sampling:
``input_sentence_size=0``, ``shuffle_input_sentence=False``), runs on one thread, uses a fixed
seed, and the model is written through ``model_writer`` so no input or output path is stored
in the model proto. ``hard_vocab_limit=False`` lets a small corpus (tests, ``--max-train-pairs``)
get a smaller vocabulary instead of an error.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Dict, Iterator, Sequence

import sentencepiece as spm

DEFAULT_SEED = 1234
MAX_SENTENCE_BYTES = 1 << 15  # State of the Union paragraphs exceed the default 4192


def _lines(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.rstrip("\n")
                if line:
                    yield line


def trainer_options(vocab_size: int, seed: int = DEFAULT_SEED, model_type: str = "unigram") -> Dict[str, object]:
    """The full option set, also recorded in the manifest."""
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=0.9999,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        random_seed=seed,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    )


def train_spm(inputs: Sequence[Path], model_path: Path, vocab_size: int,
              seed: int = DEFAULT_SEED, model_type: str = "unigram") -> Path:
    """Train on the lines of ``inputs`` (in order) and write ``model_path`` plus a ``.vocab``
    (``model_type``: sentencepiece's ``unigram`` or ``bpe``)."""
    opts = trainer_options(vocab_size, seed, model_type)
    spm.set_random_generator_seed(int(opts.pop("random_seed")))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=_lines(inputs), model_writer=buf,
                                   minloglevel=2, **opts)
    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(model_path, buf.getvalue())
    proc = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = "".join(f"{proc.id_to_piece(i)}\t{proc.get_score(i):g}\n" for i in range(proc.get_piece_size()))
    _atomic_write(model_path.with_suffix(".vocab"), vocab.encode("utf-8"))
    return model_path


def encode_file(model_path: Path, src: Path, dst: Path, batch: int = 4096) -> int:
    """Write the pieces of every line of ``src`` to ``dst`` (space separated); returns piece count."""
    proc = spm.SentencePieceProcessor(model_file=str(model_path))
    total = 0
    tmp = Path(str(dst) + ".tmp")
    with open(src, encoding="utf-8") as fin, open(tmp, "w", encoding="utf-8") as fout:
        lines = [l.rstrip("\n") for l in fin]
        for i in range(0, len(lines), batch):
            for pieces in proc.encode(lines[i:i + batch], out_type=str):
                total += len(pieces)
                fout.write(" ".join(pieces) + "\n")
    os.replace(tmp, dst)
    return total


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
