"""The cluster recipes in ``scripts/recipes/``, end to end in their CPU-sized mode.

Each test writes a tiny raw corpus (random words; English-German or monolingual) and runs
the script as a user would (``CPU=1 RAW=... WORK=... scripts/recipes/<name>.sh``): sentencepiece
or words, ``fairseq-preprocess``, training on 2 gloo ranks with torchrun + ``fairseq-train`` or
with the EmbRace DeepSpeed launcher (the ``deepspeed`` launcher + ``embrace_fairseq.deepspeed_adapter.train`` on
CPU), then ``fairseq-generate`` + sacrebleu or ``fairseq-eval-lm``. The checks: the script
exits 0, training reached its updates, the checkpoint holds full embedding tables, and a BLEU /
perplexity line is printed. Tools come from the venv running the tests (``EMBRACE_VENV``).
"""
from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from fairseq_corpus import REPO_ROOT, fairseq_env, free_port

RECIPES = REPO_ROOT / "scripts" / "recipes"
VENV = Path(sys.executable).parent.parent  # not resolved: the venv's python is a symlink
N_TEST = 20
MAX_UPDATE = 12


def _write(path: Path, lines) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def write_parallel_corpus(raw: Path, seed: int = 0) -> None:
    """train/valid/test .en/.de: random English-looking words, German = a fixed word mapping."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    en = sorted({"".join(rng.choice("abcdefghik") for _ in range(rng.randint(2, 6))) for _ in range(120)})
    de = {w: "x" + w[::-1] for w in en}
    for split, n in (("train", 300), ("valid", 30), ("test", N_TEST)):
        sents = [[rng.choice(en) for _ in range(rng.randint(3, 10))] for _ in range(n)]
        _write(raw / f"{split}.en", (" ".join(s) for s in sents))
        _write(raw / f"{split}.de", (" ".join(de[w] for w in s) for s in sents))


def write_monolingual_corpus(raw: Path, seed: int = 1) -> None:
    """train/valid/test.txt of random words (a few hundred lines)."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice("abcdefghik") for _ in range(rng.randint(2, 7))) for _ in range(400)})
    for split, n in (("train", 300), ("valid", 30), ("test", 30)):
        _write(raw / f"{split}.txt", (" ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))
                                      for _ in range(n)))


def run_recipe(script: str, env: Dict[str, str], timeout: float = 600) -> str:
    """``bash scripts/recipes/<script>`` in CPU mode; returns stdout + stderr, raises on failure."""
    child = fairseq_env({"CPU": "1", "EMBRACE_VENV": str(VENV), "MASTER_PORT": str(free_port()),
                         "MAX_UPDATE": str(MAX_UPDATE), **env})
    cmd = ["bash", str(RECIPES / script)]
    try:
        proc = subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=env.get("WORK"))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} timed out after {timeout}s") from e
    out = proc.stdout + "\n" + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{out[-8000:]}"
    return out


def assert_trained(out: str, launcher: str) -> None:
    # fairseq's loop under both launchers: epoch summary and its own closing line
    assert re.search(rf"\| train \| .*num_updates {MAX_UPDATE}\b", out), (launcher, out[-4000:])
    assert "done training" in out


def full_table_rows(ckpt: Path, key: str) -> int:
    import torch

    return torch.load(ckpt, map_location="cpu", weights_only=False)["model"][key].shape[0]


@pytest.fixture(scope="module")
def wmt_dirs(tmp_path_factory):
    """One raw corpus and one WORK folder: the second launcher reuses spm/ and data-bin/."""
    base = tmp_path_factory.mktemp("wmt14_recipe")
    write_parallel_corpus(base / "raw")
    return base / "raw", base / "work"


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lm_recipe")
    write_monolingual_corpus(base / "raw")
    return base / "raw", base / "work"


@pytest.mark.slow
@pytest.mark.parametrize("launcher,size", [("torchrun", "base"), ("deepspeed", "big")])
def test_wmt14_recipe_cpu(wmt_dirs, launcher, size):
    from fairseq.data import Dictionary

    raw, work = wmt_dirs
    work.mkdir(exist_ok=True)
    out = run_recipe("wmt14_en_de.sh", {"RAW": str(raw), "WORK": str(work), "LAUNCHER": launcher, "SIZE": size})
    arch = "embrace_transformer_wmt_en_de" if size == "base" else "embrace_transformer_vaswani_wmt_en_de_big"
    assert f"training {arch} on 2 CPU ranks with {launcher}" in out
    assert_trained(out, launcher)

    save = work / "checkpoints" / f"{size}_{launcher}"
    ckpt = save / "checkpoint_last.pt"
    assert ckpt.is_file()
    # the checkpoint holds the full shared table, not one rank's shard
    vocab = len(Dictionary.load(str(work / "data-bin" / "dict.en.txt")))
    assert full_table_rows(ckpt, "encoder.embed_tokens.weight") == vocab

    # every test sentence translated, in order, and scored
    hyps = (save / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == N_TEST
    bleu = re.search(r"^BLEU\|nrefs:1\|.*= (\d+\.\d+) ", out, re.M)
    assert bleu, out[-4000:]
    assert bleu.group(0) in (save / "bleu.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("launcher,model,tokenize", [("torchrun", "gpt", "spm"), ("deepspeed", "wiki103", "word")])
def test_lm_large_vocab_recipe_cpu(lm_dirs, launcher, model, tokenize):
    from fairseq.data import Dictionary

    raw, work = lm_dirs
    work.mkdir(exist_ok=True)
    out = run_recipe("lm_large_vocab.sh", {"RAW": str(raw), "WORK": str(work), "LAUNCHER": launcher,
                                           "MODEL": model, "TOKENIZE": tokenize})
    arch = "embrace_transformer_lm_gpt" if model == "gpt" else "embrace_transformer_lm"
    assert f"training {arch} ({model}) on 2 CPU ranks with {launcher}" in out
    assert_trained(out, launcher)

    ckpt = work / "checkpoints" / f"{model}_{launcher}" / "checkpoint_last.pt"
    assert ckpt.is_file()
    vocab = len(Dictionary.load(str(work / "data-bin" / tokenize / "dict.txt")))
    assert full_table_rows(ckpt, "decoder.embed_tokens.weight") == vocab

    ppl = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out)
    assert ppl, out[-4000:]
    # an untrained model is near the vocabulary size; anything finite and positive is a score
    assert 1.0 < float(ppl.group(2)) < 10 * vocab
    # every test token was scored (this fairseq drops an uneven last batch unless told not to)
    n_test = re.search(r"test\.txt: \d+ sents, (\d+) tokens", out)
    if n_test:  # printed when this run binarised the data
        assert re.search(rf"Evaluated {int(n_test.group(1)):,} tokens", out)


@pytest.mark.parametrize("script,missing", [("wmt14_en_de.sh", "train.en"), ("lm_large_vocab.sh", "train.txt")])
def test_recipe_names_missing_raw_file(tmp_path, script, missing):
    """Fast: a RAW folder without the expected files stops before any work, naming the file."""
    env = fairseq_env({"CPU": "1", "EMBRACE_VENV": str(VENV), "RAW": str(tmp_path / "raw"),
                       "WORK": str(tmp_path / "work")})
    proc = subprocess.run(["bash", str(RECIPES / script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"missing or empty {tmp_path / 'raw' / missing}" in proc.stderr
    assert not (tmp_path / "work").exists()
