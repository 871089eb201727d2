"""``fairseq-train --fp16`` (fairseq's ``FP16Optimizer``, fp32 master copies) with EmbRace.

fairseq's flat fp32 copy lives on a CUDA device, so stock fairseq on CPU ranks takes
``--fp16-no-flatten-grads`` (per-parameter copies, the same arithmetic); EmbRace models always
take per-parameter copies, their shards marked (``fairseq_adapter/fp16_masters.py``), so the
user's plain ``--fp16`` is what runs here. fp16 weights and activations on gloo CPU ranks:

* 3 ranks (a 56-row shared table: 19, 19, 18 rows), clipping on (``--clip-norm 0.25``, below
  the gradient norm: the update depends on the norm over every rank's shard): EmbRace's
  losses, gradient norms and loss scale are stock's, within fp16 rounding;
* the same with the tied output layer vocab-parallel;
* the checkpoint (full tables, the fp32 masters' Adam moments gathered) resumes on 2 ranks
  as stock's does.

The shards' copies unmarked, the gradient norm leaves out the other ranks' rows: the norms
and, through clipping, the losses depart from stock's from the first update.
"""
from __future__ import annotations

import pytest

from fairseq_corpus import make_translation_corpus, run_fairseq_train

pytest.importorskip("fairseq")

from test_fairseq_plugin import TINY_MT  # noqa: E402  (the plugin tests' tiny translation model)

FP16 = [
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints", "--num-workers", "0",
    "--log-format", "json", "--log-interval", "1", "--task", "translation", "--share-all-embeddings",
    "--max-tokens", "120", "--ddp-backend", "legacy_ddp", "--fp16", "--clip-norm", "0.25",
]
#: fp16 weights: the two runs sum the same rows in another order, rounded to 11 bits
LOSS_REL, GNORM_REL = 2e-4, 2e-3


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    return make_translation_corpus(tmp_path_factory.mktemp("fp16_mt"), vocab_size=51, n_train=240, n_valid=24)


def _train(data, arch, save_dir, nproc, max_update, extra=()):
    stock_only = ["--fp16-no-flatten-grads"] if arch == "transformer" else []  # fairseq's flat copy needs CUDA
    args = [str(data), "--arch", arch, *TINY_MT, *FP16, *stock_only, "--max-update", str(max_update),
            "--save-dir", str(save_dir), *extra]
    return run_fairseq_train(args, nproc=nproc, env={"EMBRACE_LOG_PRECISION": "8"}, timeout=400).check()


def _assert_same(stock, ours, first_update):
    assert [int(r["num_updates"]) for r in ours.updates] == [int(r["num_updates"]) for r in stock.updates]
    assert int(ours.updates[0]["num_updates"]) == first_update
    for a, b in zip(stock.updates, ours.updates):
        assert a["loss_scale"] == b["loss_scale"], (a, b)
        assert abs(float(a["loss"]) - float(b["loss"])) <= LOSS_REL * float(a["loss"]), (a, b)
        assert abs(float(a["gnorm"]) - float(b["gnorm"])) <= GNORM_REL * float(a["gnorm"]), (a, b)
        assert float(a["gnorm"]) > 0.25  # clipping acted: the update depended on the whole norm


def test_fp16_as_stock_on_three_ranks_and_resumed_on_two(mt_data, tmp_path):
    stock = _train(mt_data, "transformer", tmp_path / "stock", 3, 8)
    ours = _train(mt_data, "embrace_transformer", tmp_path / "ours", 3, 8)
    assert "EmbRace --fp16: fp32 master copies per parameter" in ours.output, ours.output[-3000:]
    _assert_same(stock, ours, 1)
    # the tied output layer vocab-parallel (auto gathers the tiny table): fp16 logits per shard
    vocab_parallel = _train(mt_data, "embrace_transformer", tmp_path / "ours_vp", 3, 8,
                            ["--embrace-output", "vocab-parallel"])
    assert "EmbRace output layer: vocab-parallel (forced" in vocab_parallel.output
    _assert_same(stock, vocab_parallel, 1)
    stock2 = _train(mt_data, "transformer", tmp_path / "stock", 2, 12)
    ours2 = _train(mt_data, "embrace_transformer", tmp_path / "ours", 2, 12)
    _assert_same(stock2, ours2, 9)
