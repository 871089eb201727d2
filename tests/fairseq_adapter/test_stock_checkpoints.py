"""Stock checkpoints in, stock checkpoints out, for every EmbRace family.

A checkpoint written by the stock architecture (``transformer``, ``transformer_lm``,
``roberta``) is restored into the EmbRace one on 2 ranks (default run) and 3 ranks
(slow) through fairseq's own start-up (``--restore-file`` with ``--reset-*``, and
``--finetune-from-model``), saved again with no update in between, and exported with
``embrace-export-stock``: every tensor of the export equals the stock checkpoint's,
bit for bit, under the same keys and the stock architecture's name. The stock weights
are perturbed and drawn from another seed than the EmbRace model's, so a load that
did nothing cannot pass. A checkpoint whose table has rows the dictionary lacks (as
mBART's language tokens) stops every rank at start-up with an error naming both sizes.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from embrace_fairseq.tools.export_stock import export
from embrace_fairseq.tools.local_ranks import run_ranks
from fairseq_corpus import make_lm_corpus, make_translation_corpus
from rank_fns_roberta import ROBERTA_TINY, restore_and_save, setup

importlib.import_module("embrace_fairseq.fairseq_adapter")  # registers the architectures, allow-lists globals

TINY_MT = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
           "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
           "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
TINY_LM = ["--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32"]
RESET = ["--reset-optimizer", "--reset-dataloader", "--reset-meters", "--reset-lr-scheduler"]

#: family -> (task, stock architecture, flags, table key)
FAMILIES = {
    "transformer": ("translation", "transformer", TINY_MT + ["--share-all-embeddings"], "encoder.embed_tokens.weight"),
    "transformer_lm": ("language_modeling", "transformer_lm", TINY_LM + ["--share-decoder-input-output-embed"],
                       "decoder.embed_tokens.weight"),
    "roberta": ("masked_lm", "roberta", ROBERTA_TINY, "encoder.sentence_encoder.embed_tokens.weight"),
}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Binarised on first use: the default run needs only the monolingual one.
    47 / 51 words + 4 specials, padded to 56 rows (masked_lm adds <mask>: 57). The same
    arguments as test_fairseq_plugin's corpora: a session that ran that module copies them."""
    made = {}

    def get(kind):
        if kind not in made:
            if kind == "translation":
                made[kind] = make_translation_corpus(tmp_path_factory.mktemp("ck_mt"), vocab_size=51, n_train=240,
                                                     n_valid=24)
            else:
                made[kind] = make_lm_corpus(tmp_path_factory.mktemp("ck_lm"), vocab_size=47, n_train=200, n_valid=20)
        return made[kind]

    return get


def _data(corpora, task):
    return str(corpora("translation" if task == "translation" else "lm"))


def _stock_checkpoint(corpora, family, path):
    """A checkpoint as stock fairseq-train writes it (its Trainer), weights perturbed."""
    from fairseq.trainer import Trainer

    task_name, arch, flags, _ = FAMILIES[family]
    cfg, task = setup(_data(corpora, task_name), task_name, arch, flags,
                      ["--optimizer", "adam", "--lr", "0.001", "--max-tokens", "64"])
    torch.manual_seed(7)
    model = task.build_model(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    trainer.consolidate_optimizer()  # as checkpoint_utils.save_checkpoint does first
    trainer.save_checkpoint(str(path), {"train_iterator": {"epoch": 1}, "val_loss": None})
    return str(path)


def _load(path):
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals
    from embrace_fairseq.guards.safe_load import load

    return load(str(path), fairseq_checkpoint_globals(), map_location="cpu")


def _arch(model_cfg):
    return model_cfg.get("_name") if isinstance(model_cfg, dict) else model_cfg._name


def _cases(corpora, tmp_path, families, extra_rows=False):
    cases, stock = [], {}
    for family in families:
        task_name, arch, flags, table_key = FAMILIES[family]
        path = _stock_checkpoint(corpora, family, tmp_path / f"{family}_stock.pt")
        stock[family] = path
        for how, load in (("restore", ["--restore-file", path, *RESET]), ("finetune", ["--finetune-from-model", path])):
            cases.append({"family": family, "how": how, "data": _data(corpora, task_name), "task": task_name,
                          "arch": "embrace_" + arch, "flags": flags, "load": load,
                          "save_dir": str(tmp_path / f"{family}_{how}")})
    return cases, stock


def _bigger_table(stock_path, tmp_path):
    """The stock RoBERTa checkpoint with 4 more table rows than the dictionary (tokens added
    after the dictionary was written, as mBART's language tokens are)."""
    state = _load(stock_path)
    for key in ("encoder.sentence_encoder.embed_tokens.weight", "encoder.lm_head.weight", "encoder.lm_head.bias"):
        t = state["model"][key]
        state["model"][key] = torch.cat([t, t[:4]])
    bigger = tmp_path / "bigger.pt"
    torch.save(state, bigger)
    return str(bigger)


def _check(corpora, tmp_path, world, families, mismatch):
    cases, stock = _cases(corpora, tmp_path, families)
    if mismatch:
        bigger = _bigger_table(stock["roberta"], tmp_path)
        cases += [dict(c, save_dir=c["save_dir"] + "_bad", expect_error=True,
                       load=[bigger if a == stock["roberta"] else a for a in c["load"]])
                  for c in cases if c["family"] == "roberta"]
    results = run_ranks(restore_and_save, world, cases, timeout_s=300)
    for case, res in zip(cases, results[0]):
        if case.get("expect_error"):
            continue
        assert "error" not in res, res
        rows = FAMILIES[case["family"]][3]
        want = _load(stock[case["family"]])
        table = want["model"][rows]
        assert res["shards"]["ShardedEmbedding"] == -(-table.shape[0] // world)  # rank 0 holds 1/N of the rows
        exported = tmp_path / f"{case['family']}_{case['how']}_export.pt"
        export(f"{case['save_dir']}/checkpoint_last.pt", str(exported))  # the command's own steps
        out = torch.load(exported, weights_only=True)  # nothing to allow-list
        assert _arch(out["cfg"]["model"]) == _arch(want["cfg"]["model"]) == FAMILIES[case["family"]][1]
        assert sorted(out["model"]) == sorted(want["model"]), (case["family"], case["how"])
        for key, tensor in want["model"].items():
            got = out["model"][key]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (case["family"], case["how"], key)
    for rank_results in results:  # every rank stopped, with the sizes, the cause and the fix
        for case, res in zip(cases, rank_results):
            if not case.get("expect_error"):
                continue
            assert "error" in res, res
            msg = res["error"]
            assert "TableSizeMismatch" in msg and "has 61 rows" in msg and "dictionary has 57 entries" in msg, msg
            assert "--langs" in msg and "dict.txt" in msg, msg


def test_roberta_stock_checkpoint_round_trip_and_size_mismatch_two_ranks(corpora, tmp_path):
    """RoBERTa, 2 ranks: restore and fine-tune from a stock checkpoint, save, export: bit-exact;
    a checkpoint whose table has 4 rows more than the dictionary stops every rank."""
    _check(corpora, tmp_path, 2, ["roberta"], mismatch=True)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_stock_checkpoints_round_trip_every_family(corpora, tmp_path, world):
    _check(corpora, tmp_path, world, list(FAMILIES), mismatch=world == 3)
