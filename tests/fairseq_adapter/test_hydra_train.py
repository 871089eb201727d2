"""``fairseq-hydra-train``, the entry fairseq's RoBERTa and XLM-R recipes use, with EmbRace.

fairseq's own pretraining config (``examples/roberta/config/pretraining/base.yaml``, as
shipped in the fairseq package) shrunk by overrides to a tiny model, under torchrun on CPU:

* ``embrace-hydra-train`` trains ``embrace_roberta`` on 3 ranks (a 49-row table: 17, 16, 16
  rows) with the losses and gradient norms of stock ``roberta`` run the same way, as one job
  of 3 ranks (the logged batch is 3 ranks' worth);
* the fine-tuning config (``finetuning/rte.yaml``) restores that stock checkpoint into
  ``embrace_roberta`` on 3 ranks, with stock's losses, accuracies and validation;
* plain ``fairseq-hydra-train`` with ``common.user_dir`` imports the plugin after it has set
  up each process to train alone; it stops on every rank, naming ``embrace-hydra-train``,
  instead of training 3 models side by side.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from fairseq_corpus import USER_DIR, make_classification_corpus, make_lm_corpus, run_fairseq_train

fairseq = pytest.importorskip("fairseq")

CONFIGS = Path(fairseq.__file__).parent / "examples" / "roberta" / "config"
VOCAB = 49
BATCH = 4


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_corpus(tmp_path_factory.mktemp("hydra_lm"), vocab_size=VOCAB - 5, n_train=200, n_valid=20,
                          extra_preprocess_args=["--padding-factor", "1"])


def _recipe(config: str, arch: str, save_dir: Path, *extra: str) -> List[str]:
    """A recipe's config (``pretraining/base`` or ``finetuning/rte``), shrunk: a 1-layer model of
    width 16, fp32 on CPU ranks, 6 updates; ``extra``: the task's own overrides."""
    return [
        "--config-dir", str(CONFIGS / Path(config).parent), "--config-name", Path(config).name,
        "common.fp16=false", "common.cpu=true", "common.log_interval=1", "common.seed=3",
        "distributed_training.distributed_backend=gloo", "distributed_training.ddp_backend=legacy_ddp",
        "dataset.num_workers=0", "optimization.max_update=6", "lr_scheduler.warmup_updates=2",
        f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={save_dir}/hydra",
        f"model._name={arch}", "+model.encoder_layers=1", "+model.encoder_embed_dim=16",
        "+model.encoder_ffn_embed_dim=32", "+model.encoder_attention_heads=2", "model.dropout=0",
        "model.attention_dropout=0", *extra,
    ]


def _overrides(data: Path, arch: str, save_dir: Path, *extra: str) -> List[str]:
    """The pretraining recipe on the masked-LM corpus: 32 tokens, :data:`BATCH` sentences a rank."""
    return _recipe("pretraining/base", arch, save_dir, f"task.data={data}", "task.tokens_per_sample=32",
                   "task.sample_break_mode=none", f"dataset.batch_size={BATCH}", "optimization.update_freq=[1]",
                   *extra)


def _hydra(script: str, args: List[str], nproc: int):
    return run_fairseq_train(args, nproc=nproc, script=script, user_dir=None, json_log=False,
                             env={"EMBRACE_LOG_PRECISION": "8"}, timeout=400)


@pytest.fixture(scope="module")
def stock_pretraining(lm_data, tmp_path_factory):
    """Stock ``roberta`` pretrained with the recipe's config on 3 ranks: (run, save dir)."""
    save = tmp_path_factory.mktemp("hydra_stock")
    return _hydra("embrace-hydra-train", _overrides(lm_data, "roberta", save), 3).check(), save


def _same_updates(stock, ours, keys=("loss", "gnorm")):
    assert len(stock.updates) == len(ours.updates) > 0
    for a, b in zip(stock.updates, ours.updates):
        for k in keys:
            assert abs(float(a[k]) - float(b[k])) <= 1e-4 * abs(float(a[k])) + 1e-6, (k, a, b)


def test_embrace_hydra_train_as_stock_on_three_ranks(lm_data, stock_pretraining, tmp_path):
    stock, _ = stock_pretraining
    ours = _hydra("embrace-hydra-train", _overrides(lm_data, "embrace_roberta", tmp_path / "ours",
                                                    "+model.embrace_output=vocab-parallel"), 3).check()
    assert "EmbRace output layer: vocab-parallel (forced" in ours.output, ours.output[-3000:]
    assert "EmbRace 2D schedule:" in ours.output, ours.output[-3000:]
    for run in (stock, ours):
        steps = run.updates
        assert [int(r["num_updates"]) for r in steps] == list(range(1, 7)), run.output[-3000:]
        # one job of 3 ranks: rank 0 logs every update, with every rank's sentences counted
        assert all(int(r["bsz"]) == 3 * BATCH for r in steps), steps
    _same_updates(stock, ours)
    assert (tmp_path / "ours" / "checkpoint_last.pt").exists()


def test_stock_checkpoint_fine_tuned_with_the_recipe_config(lm_data, stock_pretraining, tmp_path):
    """What an XLM-R user runs: the recipe's fine-tuning config, a stock checkpoint restored."""
    _, pretrained = stock_pretraining
    cls = make_classification_corpus(tmp_path / "cls", vocab_size=VOCAB - 5, srcdict=lm_data / "dict.txt")

    def fine_tune(arch: str):
        return _hydra("embrace-hydra-train", _recipe(
            "finetuning/rte", arch, tmp_path / arch, f"task.data={cls}", "task.num_classes=3",
            f"checkpoint.restore_file={pretrained / 'checkpoint_last.pt'}", "dataset.batch_size=8",
            "optimization.max_epoch=0", "+lr_scheduler.total_num_update=6"), 3).check()

    stock, ours = fine_tune("roberta"), fine_tune("embrace_roberta")
    assert "EmbRace 2D schedule:" in ours.output, ours.output[-3000:]
    assert all(int(r["bsz"]) == 24 for r in ours.updates)  # 3 ranks x 8 sentences
    _same_updates(stock, ours, ("loss", "accuracy"))
    valid = [(r["valid_loss"], r["valid_accuracy"]) for r in stock.tagged("valid")]
    assert valid and valid == [(r["valid_loss"], r["valid_accuracy"]) for r in ours.tagged("valid")]


def test_fairseq_hydra_train_with_the_user_dir_stops_on_every_rank(lm_data, tmp_path):
    run = _hydra("fairseq-hydra-train", _overrides(lm_data, "embrace_roberta", tmp_path / "late",
                                                   f"common.user_dir={USER_DIR}"), 2)
    assert run.returncode != 0
    message = "loaded the EmbRace user dir after it had set up this process to train alone"
    assert run.output.count(message) >= 2, run.output[-3000:]  # each rank, on its own
    assert "Start it as embrace-hydra-train" in run.output
    assert not run.updates  # no rank trained
