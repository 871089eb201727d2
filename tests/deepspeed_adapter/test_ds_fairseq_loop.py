"""embrace-ds-train runs fairseq's own training loop (fairseq_cli.train with the DeepSpeed
trainer): on 2 CPU ranks its logged per-update losses equal fairseq-train's, its log lines
carry the same keys, and fairseq's flags that DeepSpeed must own are mapped or refused."""
import argparse
import json

import pytest
import torch

pytest.importorskip("deepspeed")

from fairseq_corpus import losses_by_update, make_translation_corpus, run_ds_train, run_fairseq_train  # noqa: E402

TINY_MT = ["--task", "translation", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
           "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
           "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
           "--max-tokens", "256", "--optimizer", "adam", "--lr", "0.002", "--adam-betas", "(0.9,0.98)",
           "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3", "--clip-norm", "0.5", "--dropout", "0.1",
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--seed", "3",
           "--max-update", "7", "--no-save"]
PRECISION = {"EMBRACE_LOG_PRECISION": "8"}  # fairseq rounds logged values to 3 digits
STOCK_FLAGS = ["--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    return make_translation_corpus(tmp_path_factory.mktemp("ds_loop") / "corpus", n_train=200)


def _ds_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0},
                                "embrace": {"piece_bytes": 4096, "bucket_bytes": 16384}}))
    return path


def _assert_same_run(stock, ds):
    """Per-update losses within 1e-4 and the same keys in train_inner / valid / train lines."""
    want, got = losses_by_update(stock.output), losses_by_update(ds.output)
    assert want and sorted(got) == sorted(want), (sorted(want), sorted(got), ds.output[-3000:])
    for u in want:
        assert got[u] == pytest.approx(want[u], abs=1e-4), (u, want, got)
    for tag in ("train_inner", "valid", "train"):
        assert stock.tagged(tag), (tag, stock.output[-2000:])
        assert [sorted(r) for r in ds.tagged(tag)] == [sorted(r) for r in stock.tagged(tag)], tag
    for key in ("loss", "nll_loss", "ppl", "wpb", "bsz", "lr", "gnorm", "clip"):
        for a, b in zip(stock.updates, ds.updates):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-3, abs=1e-4), (key, a, b)


@pytest.mark.slow  # ~20 s on 2 idle cores, 40-76 s on a loaded machine (two launches)
def test_stock_transformer_same_losses_and_keys_as_fairseq_train(mt_data, tmp_path):
    """Stock ``transformer`` on 2 CPU ranks: fairseq-train (torchrun) and embrace-ds-train
    (the deepspeed launcher): per-update losses within 1e-4, same log keys."""
    args = [str(mt_data), *TINY_MT, "--arch", "transformer", "--save-dir", str(tmp_path)]  # --no-save: only made
    stock = run_fairseq_train([*args, *STOCK_FLAGS], env=PRECISION, timeout=600).check()
    ds = run_ds_train(mt_data, args[1:], _ds_json(tmp_path), env=PRECISION).check()
    assert "DeepSpeed engine: ZeRO stage 0" in ds.output
    _assert_same_run(stock, ds)


@pytest.mark.slow  # ~25 s idle, ~110 s on a loaded machine: two runs with --update-freq 2
def test_embrace_under_deepspeed_with_update_freq_equals_stock(mt_data, tmp_path):
    """``embrace_transformer`` (sharded tables, 2D schedule) under the DeepSpeed loop with
    --update-freq 2 (DeepSpeed's gradient accumulation) equals the stock ``transformer``
    under fairseq-train within 1e-4 per update; checkpoints follow fairseq's naming and
    --keep-last-epochs."""
    until = TINY_MT.index("--max-update")
    common = [*TINY_MT[:until], *TINY_MT[until + 2:-1], "--update-freq", "2", "--max-epoch", "2", "--keep-last-epochs", "1"]
    stock = run_fairseq_train([str(mt_data), *common, "--arch", "transformer", "--save-dir", str(tmp_path / "stock"),
                               *STOCK_FLAGS], env=PRECISION, timeout=600).check()
    ds = run_ds_train(mt_data, [*common, "--arch", "embrace_transformer", "--save-dir", str(tmp_path / "ds")],
                      _ds_json(tmp_path), launcher="torchrun", env=PRECISION).check()
    assert "gradient accumulation 2" in ds.output
    _assert_same_run(stock, ds)
    assert sorted(p.name for p in (tmp_path / "ds").glob("*.pt")) == sorted(
        p.name for p in (tmp_path / "stock").glob("*.pt")) == ["checkpoint2.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    ckpt, stock_ckpt = (torch.load(tmp_path / d / "checkpoint_last.pt", weights_only=False) for d in ("ds", "stock"))
    table = "encoder.embed_tokens.weight"
    assert ckpt["model"][table].shape == stock_ckpt["model"][table].shape  # full table, not a shard
    assert ckpt["optimizer_history"][-1]["num_updates"] == int(ds.updates[-1]["num_updates"]) == int(
        stock.updates[-1]["num_updates"])


def test_embrace_under_deepspeed_with_checkpointed_activations_equals_stock(mt_data, tmp_path):
    """fairseq's ``--checkpoint-activations`` (each layer recomputed in a backward of its own
    inside the step's, every dense gradient of this post-norm, shared-table model in one of
    those): ``embrace_transformer`` under the DeepSpeed loop equals the stock model under
    fairseq-train within 1e-4 per update."""
    common = [*TINY_MT, "--checkpoint-activations"]
    stock = run_fairseq_train([str(mt_data), *common, "--arch", "transformer", "--save-dir", str(tmp_path / "stock"),
                               *STOCK_FLAGS], env=PRECISION, timeout=600).check()
    ds = run_ds_train(mt_data, [*common, "--arch", "embrace_transformer", "--save-dir", str(tmp_path / "ds")],
                      _ds_json(tmp_path), launcher="torchrun", env=PRECISION).check()
    assert "EmbRace 2D schedule" in ds.output, ds.output[-3000:]
    _assert_same_run(stock, ds)


# --------------------------------------------------------------------------- start-up mapping (fast)


def _args(**kw):
    base = dict(update_freq=[1], lr=[0.25], clip_norm=0.0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_update_freq_is_gradient_accumulation():
    from embrace_fairseq.deepspeed_adapter.fairseq_options import FairseqOptionConflict
    from embrace_fairseq.deepspeed_adapter.train import apply_json_values, apply_update_freq

    ds, args = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, _args(update_freq=[4])
    apply_update_freq(ds, args, ["--update-freq", "4"])
    assert ds["gradient_accumulation_steps"] == 4 and "train_batch_size" not in ds
    ds, args = {"gradient_accumulation_steps": 3}, _args()
    apply_update_freq(ds, args, [])  # the JSON's value stands when the flag is not given
    assert args.update_freq == [3] and ds["train_micro_batch_size_per_gpu"] == 1
    with pytest.raises(FairseqOptionConflict, match="--update-freq 2 disagrees"):
        apply_update_freq({"gradient_accumulation_steps": 3}, _args(update_freq=[2]), ["--update-freq", "2"])
    with pytest.raises(FairseqOptionConflict, match="one number"):
        apply_update_freq({}, _args(update_freq=[1, 2]), ["--update-freq", "1,2"])
    args = _args()
    apply_json_values({"optimizer": {"type": "Adam", "params": {"lr": 5e-4}}, "gradient_clipping": 1.0}, args, [])
    assert args.lr == [5e-4] and args.clip_norm == 1.0
    args = _args(lr=[1e-3])
    apply_json_values({"optimizer": {"params": {"lr": 5e-4}}}, args, ["--lr", "0.001"])
    assert args.lr == [1e-3]  # given: fairseq_options checks it against the JSON


def test_sample_size_is_known_before_backward_and_bad_flags_stop():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError
    from embrace_fairseq.deepspeed_adapter.trainer import check_supported, expected_sample_size

    sample = {"ntokens": 17, "target": torch.zeros(3, 6, dtype=torch.long)}
    assert expected_sample_size(SimpleNamespace(sentence_avg=False), sample) == 17.0
    assert expected_sample_size(SimpleNamespace(sentence_avg=True), sample) == 3.0
    cfg = OmegaConf.create({
        "common": {"fp16": True, "bf16": False, "amp": False, "memory_efficient_fp16": False, "model_parallel_size": 1},
        "optimization": {"use_bmuf": False, "update_freq": [1]},
        "distributed_training": {"ddp_backend": "pytorch_ddp", "zero_sharding": "none", "pipeline_model_parallel": False},
        "ema": {"store_ema": False}})
    with pytest.raises(EmbraceConfigError, match="--fp16.*DeepSpeed config"):
        check_supported(cfg)
    cfg.common.fp16 = False
    check_supported(cfg)
