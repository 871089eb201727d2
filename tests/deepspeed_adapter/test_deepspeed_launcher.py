"""embrace-ds-train: fairseq flags mapped to DeepSpeed, validation, atomic checkpoints,
and resume that repeats the uninterrupted run exactly (real ranks via torchrun)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from fairseq_corpus import fairseq_env, losses_by_update, make_lm_corpus, parse_json_records, run_fairseq_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_LM = ["--task", "language_modeling", "--arch", "embrace_transformer_lm", "--share-decoder-input-output-embed",
           "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--max-tokens", "256",
           "--optimizer", "adam", "--lr", "0.002", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
           "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3", "--clip-norm", "0.5", "--dropout", "0.1",
           "--log-interval", "1", "--log-format", "json", "--seed", "3"]
#: more digits than fairseq's 3 in logged values: resumed losses are compared exactly
PRECISION = {"EMBRACE_LOG_PRECISION": "12"}


def _ds_config(tmp_path, stage=0, relaxed=False):
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
           "embrace": {"piece_bytes": 4096, "bucket_bytes": 16384, "relaxed_embedding": relaxed}}
    if relaxed:
        cfg["gradient_clipping"] = 0.0  # the relaxed dependency refuses clipping
    path = tmp_path / f"ds_stage{stage}_{relaxed}.json"
    path.write_text(json.dumps(cfg))
    return path


def _train(data, save_dir, ds_config, extra, port, relaxed=False):
    env = dict(fairseq_env(), EMBRACE_VENV=str(Path(sys.executable).parent.parent), DS_CONFIG=str(ds_config),
               MASTER_PORT=str(port), **PRECISION)
    args = [a if not (relaxed and a == "0.5") else "0.0" for a in TINY_LM]  # --clip-norm
    out = subprocess.run([str(ROOT / "scripts" / "ds_train_cpu.sh"), "2", str(data), *args, "--save-dir", str(save_dir),
                          *extra], env=env, capture_output=True, text=True, timeout=500)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    losses = losses_by_update(text)
    valid = [float(r["valid_loss"]) for r in parse_json_records(text) if r["_tag"] == "valid"]
    return losses, valid, text


@pytest.mark.slow
@pytest.mark.parametrize("stage, relaxed", [(0, False), (1, False), (0, True)])
def test_resume_repeats_the_uninterrupted_run(tmp_path, stage, relaxed):
    """Run A: 8 updates. Run B: stops after update 4 (checkpoint_last.pt there), run C
    resumes it to update 8: updates 5..8 have A's losses exactly; the checkpoint
    holds full tables and fairseq-eval-lm reads it. (ZeRO 0 and 1; relaxed dependency,
    whose launcher reads one batch ahead.)"""
    from embrace_fairseq.tools.local_ranks import free_port

    data = make_lm_corpus(tmp_path / "corpus", n_train=200)
    ds = _ds_config(tmp_path, stage, relaxed)
    full, valid, text = _train(data, tmp_path / "a", ds, ["--max-update", "8", "--save-interval-updates", "4",
                                                       "--validate-interval-updates", "4"], free_port(), relaxed)
    assert sorted(full) == list(range(1, 9)), text[-3000:]
    assert valid, text[-3000:]
    _train(data, tmp_path / "b", ds, ["--max-update", "4", "--save-interval-updates", "4"], free_port(), relaxed)
    resumed, _, text = _train(data, tmp_path / "b", ds, ["--max-update", "8", "--save-interval-updates", "4"],
                              free_port(), relaxed)
    assert "Loaded checkpoint" in text, text[-3000:]
    assert sorted(resumed) == [5, 6, 7, 8], text[-3000:]
    for u in resumed:
        assert resumed[u] == pytest.approx(full[u], rel=1e-6, abs=0), (u, resumed, full)
    ckpt = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=False)
    assert ckpt["optimizer_history"][-1]["num_updates"] == 8
    assert (tmp_path / "a" / "checkpoint_best.pt").exists()
    assert not [p for p in os.listdir(tmp_path / "b") if ".tmp" in p]
    ev = run_fairseq_tool("fairseq-eval-lm", [str(data), "--path", str(tmp_path / "b" / "checkpoint_last.pt"), "--cpu",
                                              "--tokens-per-sample", "32", "--max-tokens", "256", "--gen-subset", "test"])
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "Perplexity" in ev.stdout + ev.stderr


def test_fairseq_flags_map_to_deepspeed_and_conflicts_stop():
    import argparse

    from embrace_fairseq.deepspeed_adapter.fairseq_options import (
        FairseqOptionConflict,
        apply_fairseq_options,
        lr_lambda,
    )

    args = argparse.Namespace(optimizer="adam", lr=[0.001], adam_betas="(0.9, 0.98)", adam_eps=1e-8, weight_decay=0.01,
                              lr_scheduler="inverse_sqrt", warmup_updates=4, warmup_init_lr=-1, clip_norm=0.1, momentum=0.0)
    argv = ["--optimizer", "adam", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt", "--clip-norm", "0.1"]
    ds, make_opt, make_sched = apply_fairseq_options({"train_micro_batch_size_per_gpu": 1}, args, argv)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.98], "eps": 1e-8,
                                                            "weight_decay": 0.01, "torch_adam": True}}
    assert ds["gradient_clipping"] == 0.1 and make_opt is None and make_sched is not None
    # fairseq's inverse_sqrt: linear warm-up from 0, then lr * sqrt(warmup / u)
    fn = lr_lambda("inverse_sqrt", 0.001, 4, -1)
    assert [round(fn(u), 6) for u in (0, 2, 4, 16)] == [0.0, 0.5, 1.0, 0.5]
    with pytest.raises(FairseqOptionConflict, match="--lr"):
        apply_fairseq_options({"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}, args, argv)
    with pytest.raises(FairseqOptionConflict, match="--lr-scheduler"):
        apply_fairseq_options({"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "scheduler": {"type": "WarmupLR"}},
                              args, argv)
    sgd = argparse.Namespace(**dict(vars(args), optimizer="sgd", momentum=0.9))
    ds, make_opt, _ = apply_fairseq_options({}, sgd, ["--optimizer", "sgd"])
    assert "optimizer" not in ds and isinstance(make_opt([torch.nn.Parameter(torch.zeros(1))]), torch.optim.SGD)
