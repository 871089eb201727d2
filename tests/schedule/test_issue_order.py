"""One issue order on every rank in the single-thread (NCCL) mode, whatever gradients a rank
gets, shown on gloo with the two switches: ``EMBRACE_SINGLE_THREAD_ISSUE=1`` (the mode on
any backend) and ``EMBRACE_ISSUE_LOG=DIR`` (each rank's collectives as issued).

The real fairseq-train CLI runs the EmbRace LM with an adaptive softmax whose tail cluster
holds rare words: in some steps some ranks see none of them and get no gradient for the
tail's parameters while others do (checked from the runs' ``nograd`` logs). Every rank's
issue log must be the same line for line (op, group, element count in order), and the
losses must equal stock ``transformer_lm`` with the same flags.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from fairseq_corpus import run_fairseq_tool, run_fairseq_train

PRECISE = {"EMBRACE_LOG_PRECISION": "8"}
# several buckets and pieces of the tiny model, so that their order can differ
SMALL_PIECES = {"EMBRACE_BUCKET_BYTES": "2048", "EMBRACE_PIECE_BYTES": "1024"}
REL = 1e-4
UPDATES = 8
# 4 specials + 24 common words: the head; the rare words (and the dictionary's padding) the tail
COMMON, RARE = 24, 8
CUTOFF = "28"
LM = [
    "--task", "language_modeling", "--decoder-layers", "1", "--decoder-embed-dim", "16",
    "--decoder-input-dim", "16", "--decoder-output-dim", "16",
    "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--tokens-per-sample", "16",
    "--sample-break-mode", "none", "--adaptive-softmax-cutoff", CUTOFF, "--adaptive-softmax-dropout", "0",
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints", "--no-save",
    "--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--max-tokens", "32",
    "--ddp-backend", "legacy_ddp", "--max-update", str(UPDATES), "--disable-validation",
    "--criterion", "adaptive_loss",
]


@pytest.fixture(scope="module")
def rare_tail_data(tmp_path_factory) -> Path:
    """Common words, and rare ones at about one in 40 tokens: a 32-token batch has none
    of them about half of the time."""
    tmp = tmp_path_factory.mktemp("lm_rare")
    rng = random.Random(0)
    common = [f"c{i}" for i in range(COMMON)]
    rare = [f"r{i}" for i in range(RARE)]

    def line() -> str:
        return " ".join(rng.choice(rare) if rng.random() < 0.025 else rng.choice(common)
                        for _ in range(rng.randint(8, 20)))

    for split, n in (("train", 160), ("valid", 10)):
        (tmp / f"{split}.txt").write_text("".join(line() + "\n" for _ in range(n)), encoding="utf-8")
    # every common word before every rare one in the dictionary (sorted by count)
    (tmp / "train.txt").write_text((tmp / "train.txt").read_text() + " ".join(common * 3) + "\n")
    dest = tmp / "data-bin"
    run_fairseq_tool("fairseq-preprocess", ["--only-source", "--trainpref", str(tmp / "train.txt"),
                                            "--validpref", str(tmp / "valid.txt"), "--destdir", str(dest),
                                            "--workers", "1"], user_dir=None, check=True)
    return dest


def _losses(run):
    return [float(r["loss"]) for r in run.updates]


def _same_order_and_losses(data: Path, tmp: Path, nproc: int) -> None:
    stock = run_fairseq_train([str(data), "--arch", "transformer_lm", *LM, "--save-dir", str(tmp / "stock")],
                              nproc=nproc, env=PRECISE, timeout=400).check()
    logs = tmp / "issue"
    env = dict(PRECISE, EMBRACE_SINGLE_THREAD_ISSUE="1", EMBRACE_ISSUE_LOG=str(logs), **SMALL_PIECES)
    ours = run_fairseq_train([str(data), "--arch", "embrace_transformer_lm", *LM, "--save-dir", str(tmp / "ours")],
                             nproc=nproc, env=env, timeout=400).check()
    # the case this is about happened: a step in which the ranks differ in which
    # parameters got no gradient (the adaptive softmax's tail cluster)
    nograd = [(logs / f"nograd.rank{r}.log").read_text().split("\n") for r in range(nproc)]
    differing = [i for i, lines in enumerate(zip(*nograd)) if len(set(lines)) > 1]
    assert differing, f"no step where the ranks' gradient-less parameters differ: {nograd}"
    # one issue order on every rank
    issued = [(logs / f"issue.rank{r}.log").read_text().splitlines() for r in range(nproc)]
    assert len(issued[0]) > 10 * UPDATES, issued[0][:20]
    ops = {ln.split()[1] for ln in issued[0]}
    assert {"all_reduce", "all_to_all"} <= ops, ops
    for r in range(1, nproc):
        first = next((i for i, (a, b) in enumerate(zip(issued[0], issued[r])) if a != b), None)
        assert first is None and len(issued[r]) == len(issued[0]), (
            f"rank {r} issues in another order than rank 0 from line {first}: "
            f"{issued[0][first - 3:first + 3] if first else len(issued[0])} vs "
            f"{issued[r][first - 3:first + 3] if first else len(issued[r])}")
    # and the same training as stock
    a, b = _losses(stock), _losses(ours)
    assert len(a) == len(b) == UPDATES, (len(a), len(b))
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    assert worst <= REL, f"loss differs by {worst:.2e} relative\nstock={a}\nours={b}"


def test_one_issue_order_on_two_ranks(rare_tail_data, tmp_path):
    _same_order_and_losses(rare_tail_data, tmp_path, 2)


@pytest.mark.slow
def test_one_issue_order_on_three_ranks(rare_tail_data, tmp_path):
    _same_order_and_losses(rare_tail_data, tmp_path, 3)
