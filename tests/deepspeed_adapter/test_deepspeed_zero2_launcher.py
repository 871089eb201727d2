"""embrace-ds-train at ZeRO stage 2 (ds_config/embrace_zero2_cpu.json): the same losses as
stock DeepSpeed ZeRO-2 through the same launcher, and checkpoints that resume exactly
(and on another world size for the tables)."""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from fairseq_corpus import losses_by_update, make_lm_corpus, make_translation_corpus, run_ds_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ZERO2_JSON = ROOT / "ds_config" / "embrace_zero2_cpu.json"
#: the JSON holds the optimizer (Adam, lr 5e-4) and the clipping (1.0): fairseq's flags leave them out
TINY_MT = ["--task", "translation", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
           "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
           "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
           "--max-tokens", "256", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3", "--dropout", "0.1",
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--seed", "3",
           "--max-update", "6", "--update-freq", "2", "--no-save"]
TINY_LM = ["--task", "language_modeling", "--arch", "embrace_transformer_lm", "--share-decoder-input-output-embed",
           "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--max-tokens", "256",
           "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3", "--dropout", "0.1", "--seed", "3"]
PRECISION = {"EMBRACE_LOG_PRECISION": "12"}  # fairseq rounds logged values to 3 digits


def _stock_json(tmp_path):
    """The same DeepSpeed config without the "embrace" section: stock ZeRO-2."""
    cfg = json.loads(ZERO2_JSON.read_text())
    cfg.pop("embrace")
    path = tmp_path / "stock_zero2.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.slow
def test_embrace_zero2_equals_stock_zero2_under_the_launcher(tmp_path):
    """2 ranks, the deepspeed launcher, --update-freq 2: ``embrace_transformer`` with
    ds_config/embrace_zero2_cpu.json logs the stock ``transformer``'s per-update losses,
    gnorm and clip under the same config without "embrace" (stock DeepSpeed ZeRO-2)."""
    data = make_translation_corpus(tmp_path / "corpus", n_train=200)
    stock = run_ds_train(data, [*TINY_MT, "--arch", "transformer", "--save-dir", str(tmp_path / "s")],
                         _stock_json(tmp_path), env=PRECISION).check()
    ours = run_ds_train(data, [*TINY_MT, "--arch", "embrace_transformer", "--save-dir", str(tmp_path / "e")],
                        ZERO2_JSON, env=PRECISION).check()
    for run in (stock, ours):
        assert "DeepSpeed engine: ZeRO stage 2, gradient accumulation 2" in run.output, run.output[-3000:]
    assert ours.output.count("the 2D schedule does not apply") == 1, ours.output[-3000:]
    want, got = losses_by_update(stock.output), losses_by_update(ours.output)
    assert sorted(want) == sorted(got) == list(range(1, 7)), (want, got)
    for u in want:
        assert got[u] == pytest.approx(want[u], rel=1e-4), (u, want, got)
    assert len(stock.updates) == len(ours.updates) == 6
    for a, b in zip(stock.updates, ours.updates):
        for key in ("nll_loss", "gnorm", "clip", "lr", "wpb"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4, abs=1e-6), (key, a, b)
    assert any(float(r["clip"]) > 0 for r in ours.updates)  # the JSON's clipping acted


def _lm(data, save_dir, extra, nproc=2):
    return run_ds_train(data, [*TINY_LM, "--save-dir", str(save_dir), *extra], ZERO2_JSON, nproc, env=PRECISION)


@pytest.mark.slow
def test_zero2_checkpoint_resumes_exactly_and_tables_on_another_world_size(tmp_path):
    """Run A: 8 updates. Run B: stops after update 4, run C resumes it to 8: updates 5..8
    have A's losses exactly (DeepSpeed's partitioned ZeRO-2 state, the shard optimizer's
    full-table state). The checkpoint holds full tables: 3 ranks resume it with
    --reset-optimizer (each keeps its rows); without it, every rank stops naming the
    world size DeepSpeed's partitioned state was saved with."""
    data = make_lm_corpus(tmp_path / "corpus", n_train=200)
    full = losses_by_update(_lm(data, tmp_path / "a", ["--max-update", "8"]).check().output)
    assert sorted(full) == list(range(1, 9)), full
    _lm(data, tmp_path / "b", ["--max-update", "4", "--save-interval-updates", "4"]).check()
    ckpt = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=False)
    table = ckpt["model"]["decoder.embed_tokens.weight"]
    assert ckpt["last_optimizer_state"]["shards"]["state"][0]["exp_avg"].shape == table.shape  # full-table moments
    assert len(ckpt["last_optimizer_state"]["dense_per_rank"]) == 2
    resumed = _lm(data, tmp_path / "b", ["--max-update", "8"]).check()
    assert "Loaded checkpoint" in resumed.output
    got = losses_by_update(resumed.output)
    assert sorted(got) == [5, 6, 7, 8], got
    for u in got:
        assert got[u] == pytest.approx(full[u], rel=1e-6, abs=0), (u, got, full)

    table8 = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=False)["model"]["decoder.embed_tokens.weight"]
    refused = _lm(data, tmp_path / "b", ["--max-update", "10"], nproc=3)
    assert refused.returncode != 0
    assert refused.output.count("saved by 2 ranks") >= 3, refused.output[-3000:]  # every rank says so
    # --reset-optimizer restarts fairseq's update count: 2 updates, the first at the
    # warm-up's rate 0, the second at 5e-4 / 3, which moves no element of the table by
    # more than that (Adam's first step is lr * g / (|g| + eps)). A table not loaded, or
    # whose rows went to the wrong ranks, differs by far more.
    moved = _lm(data, tmp_path / "b", ["--max-update", "2", "--reset-optimizer"], nproc=3).check()
    assert "Loaded checkpoint" in moved.output and sorted(losses_by_update(moved.output)) == [1, 2], moved.output[-3000:]
    table = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=False)["model"]["decoder.embed_tokens.weight"]
    assert table.shape == table8.shape
    assert float((table - table8).abs().max()) < 2e-4
