"""fairseq checkpoints are in vocabulary order whatever the shard layout: a checkpoint
trained with the strided layout on 2 ranks loads on 3 ranks with the contiguous layout
and on 1 rank with identical full tables and Adam moments, and the stock tools read it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import embrace_fairseq.fairseq_adapter  # noqa: F401  (allow-lists fairseq checkpoint globals for torch.load)
from embrace_fairseq.tools.local_ranks import run_ranks

from fairseq_corpus import make_translation_corpus, run_fairseq_tool, run_fairseq_train

TINY = [
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--cpu", "--distributed-backend", "gloo", "--dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "0.003", "--seed", "3", "--no-epoch-checkpoints",
    "--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--max-tokens", "120",
    "--ddp-backend", "legacy_ddp", "--share-all-embeddings",
]


def _load_on_ranks(rank, world, ckpt, layout):
    """Every rank builds the model from the checkpoint under ``layout`` and gathers it back."""
    import embrace_fairseq.fairseq_adapter  # noqa: F401
    from fairseq import checkpoint_utils

    from embrace_fairseq.core.sharded_embedding import sharded_embeddings
    from embrace_fairseq.optim.optimizer_state import gather_sharded_state, to_local_state

    models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task(
        [ckpt], arg_overrides={"embrace_shard_layout": layout})
    table = sharded_embeddings(models[0])[0]
    state = checkpoint_utils.load_checkpoint_to_cpu(ckpt)
    opt = torch.optim.Adam(models[0].parameters())
    opt.load_state_dict(to_local_state(state["last_optimizer_state"], opt))
    moments = gather_sharded_state(opt)
    if not moments:  # one rank: the state is the full table
        moments = {i: {k: v for k, v in opt.state[p].items() if torch.is_tensor(v) and v.dim()}
                   for i, p in enumerate(opt.param_groups[0]["params"]) if p is table.weight}
    return {"layout": table.layout, "table": table.full_weight().numpy().copy(),
            "moments": {k: {n: v.numpy().copy() for n, v in d.items()} for k, d in moments.items()}}


@pytest.mark.slow  # about 60 s; in-process round trips between layouts and world sizes: tests/core/test_shard_layouts.py
def test_strided_checkpoint_loads_under_any_layout_and_world(tmp_path):
    data = make_translation_corpus(tmp_path / "mt", vocab_size=51, n_train=120, n_valid=12)
    save = tmp_path / "save"
    run_fairseq_train([str(data), "--task", "translation", "--arch", "embrace_transformer", *TINY,
                       "--max-update", "6", "--save-dir", str(save), "--embrace-shard-layout", "strided"],
                      nproc=2, timeout=400).check()
    ckpt = str(save / "checkpoint_last.pt")
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals
    from embrace_fairseq.guards.safe_load import load as safe_load

    state = safe_load(ckpt, fairseq_checkpoint_globals(), map_location="cpu")  # weights_only=True
    assert state["cfg"]["model"].embrace_shard_layout == "strided"
    saved = state["model"]["encoder.embed_tokens.weight"].numpy()
    saved_moments = {i: v for i, v in state["last_optimizer_state"]["state"].items()
                     if "exp_avg" in v and v["exp_avg"].shape == saved.shape}
    assert len(saved_moments) == 1
    for world, layout in ((3, "contiguous"), (1, "contiguous"), (1, "strided")):
        for r in run_ranks(_load_on_ranks, world, ckpt, layout, timeout_s=300):
            assert r["layout"] == layout
            assert np.array_equal(r["table"], saved), (world, layout)
            assert len(r["moments"]) == 1
            got = next(iter(r["moments"].values()))
            want = next(iter(saved_moments.values()))
            for key in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(got[key], want[key].numpy()), (world, layout, key)
    # the stock tool on one process reads it (vocabulary order: the table as fairseq's own)
    gen = run_fairseq_tool("fairseq-generate", [str(data), "--path", ckpt, "--cpu", "--beam", "2",
                                                "--max-tokens", "400", "--gen-subset", "valid"]).check()
    assert gen.output.count("\nH-") >= 5
