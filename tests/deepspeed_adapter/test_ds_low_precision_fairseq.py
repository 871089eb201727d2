"""fairseq models under DeepSpeed's fp16/bf16: buffers follow the parameters' dtype, as
under fairseq's own --fp16. DeepSpeed 0.19 casts parameters only, and without this the
sinusoidal positions (a float buffer) stopped every fairseq Transformer at its first layer
("expected mat1 and mat2 to have the same dtype"), stock and EmbRace alike; found on a GPU
with ds_config/embrace_fp16_gpu.json, and the same on CPU with bf16 (below)."""
import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from fairseq_corpus import losses_by_update, make_translation_corpus, run_ds_train  # noqa: E402

from embrace_fairseq.deepspeed_adapter.train import apply_buffer_dtype  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_MT = ["--task", "translation", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
           "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
           "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
           "--max-tokens", "256", "--dropout", "0", "--criterion", "label_smoothed_cross_entropy",
           "--label-smoothing", "0.1", "--seed", "3", "--max-update", "3", "--no-save", "--disable-validation"]


@pytest.mark.parametrize("section,want", [("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")])
def test_low_precision_buffers_follow_the_parameters(section, want):
    cfg = {section: {"enabled": True}}
    apply_buffer_dtype(cfg)
    assert cfg["data_types"] == {"buffer_dtype": want}


def test_buffer_dtype_given_or_full_precision_is_left_alone():
    given = {"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "fp32"}}
    apply_buffer_dtype(given)
    assert given["data_types"] == {"buffer_dtype": "fp32"}
    for cfg in ({}, {"fp16": {"enabled": False}}):
        apply_buffer_dtype(cfg)
        assert "data_types" not in cfg


def _bf16_config(tmp_path, embrace: bool) -> Path:
    """ds_config/embrace_cpu.json in bf16 at ZeRO stage 1 (EmbRace refuses bf16 at stage 0)."""
    cfg = json.loads((ROOT / "ds_config" / "embrace_cpu.json").read_text())
    cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1})
    if not embrace:
        cfg.pop("embrace")
    path = tmp_path / f"bf16_{'embrace' if embrace else 'stock'}.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.slow  # two launcher runs of 2 DeepSpeed ranks each, about 36 s
def test_bf16_transformer_trains_under_deepspeed_and_embrace_logs_stocks_losses(tmp_path):
    """2 gloo ranks, bf16 ZeRO-1 through scripts/ds_train_cpu.sh: the stock ``transformer``
    trains, and ``embrace_transformer`` logs its losses (bf16 rounding apart)."""
    data = make_translation_corpus(tmp_path / "corpus", n_train=120)
    env = {"EMBRACE_LOG_PRECISION": "12"}
    stock = run_ds_train(data, [*TINY_MT, "--arch", "transformer", "--save-dir", str(tmp_path / "s")],
                         _bf16_config(tmp_path, False), env=env, timeout=240).check()
    ours = run_ds_train(data, [*TINY_MT, "--arch", "embrace_transformer", "--save-dir", str(tmp_path / "e")],
                        _bf16_config(tmp_path, True), env=env, timeout=240).check()
    want, got = losses_by_update(stock.output), losses_by_update(ours.output)
    assert sorted(want) == sorted(got) == [1, 2, 3], (want, got)
    for u in want:
        assert got[u] == pytest.approx(want[u], rel=1e-3), (u, want, got)
