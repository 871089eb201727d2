"""At the real vocabulary size: a table of 250,007 rows (XLM-R's and mBART's 250k, odd so the
two shards differ by a row) on 2 real gloo ranks, width 32, trained on the project's own
path (``ShardedEmbedding``, the tied output layer read vocab-parallel, ``ShardOptimizer``).

Measured on each rank, not computed from the shard plan:

* the storages of the table, its gradient and both Adam moments
  (``untyped_storage().nbytes()``): this rank's rows x 32 x 4 bytes each, the two ranks' rows
  summing to the vocabulary; nothing else the model or the optimizer holds is as long;
* the process's resident anonymous memory (``RssAnon``) from before the model: it grows by
  the shard when the model is built, by two shards with the optimizer's moments, by one
  more with the gradient: 4/N of the replicated model's 4 tables, within 3 MB;
* every tensor any operator produces during training (forward, backward, optimizer step),
  recorded by a ``TorchDispatchMode`` below autograd: no floating-point tensor is longer
  than this rank's rows in any dimension (no ``(tokens, V)`` logits, no full table or full
  gradient), and the largest logits buffer is ``(all ranks' tokens, this rank's rows)``. The same
  recorder on the same model with the output layer planted back on the full-table path
  reports the ``(tokens, V)`` logits: it would catch them.
"""
from __future__ import annotations

import pytest

from embrace_fairseq.tools.local_ranks import run_ranks
from rank_fns_large_vocab import large_vocab_run, tokens_of

VOCAB = 250_007
DIM = 32
WORLD = 2
FLOAT = 4
# RssAnon also moves with things other than the tables (the dense layer, gloo's buffers,
# Python objects): a tenth of the full table, 3.2 MB, where a replicated table would add 32 MB.
RSS_SLACK = VOCAB * DIM * FLOAT // 10


@pytest.fixture(scope="module")
def measured():
    return run_ranks(large_vocab_run, WORLD, VOCAB, DIM, timeout_s=300)


def test_each_rank_holds_its_rows_of_table_gradient_and_adam_state(measured):
    rows = [r["memory"]["shard_rows"] for r in measured]
    assert sum(rows) == VOCAB and max(rows) - min(rows) == 1, rows
    for r, n in zip(measured, rows):
        mem = r["memory"]
        shard = n * DIM * FLOAT
        assert mem["held"] == {"table": shard, "grad": shard, "exp_avg": shard, "exp_avg_sq": shard}, mem
        assert mem["largest_held_rows"] == n and not mem["replica"], mem
        rss = mem["rss"]
        steps = {"model": rss["model"], "optimizer": rss["optimizer"] - rss["model"],
                 "trained": rss["trained"] - rss["optimizer"]}
        expected = {"model": shard, "optimizer": 2 * shard, "trained": shard}
        for what, grew in steps.items():
            assert abs(grew - expected[what]) <= RSS_SLACK, (r["rank"], what, grew, expected[what], rss)
        print(f"rank {r['rank']}: {n} rows; held table/grad/exp_avg/exp_avg_sq {shard / 2**20:.1f} MiB each; "
              f"resident memory grew {rss['trained'] / 2**20:.1f} MiB (replicated: "
              f"{4 * VOCAB * DIM * FLOAT / 2**20:.1f} MiB); peak RSS {mem['peak_rss'] / 2**20:.0f} MiB")


def test_no_rank_forms_full_vocabulary_logits(measured):
    total = sum(tokens_of(q) for q in range(WORLD))
    for r in measured:
        vp, rows = r["vocab_parallel"], r["memory"]["shard_rows"]
        assert vp["recorded"] > 100, vp  # the recorder saw the step's operators
        assert vp["float_wider"] == [], vp["float_wider"][:10]
        # the logits buffer: every rank's tokens against this rank's rows (and no more)
        assert max(vp["logits_buffers"]) == (total, rows), vp["logits_buffers"]
        # the loss it computed over the shards is the full-table loss (computed apart)
        assert vp["losses"][0] == pytest.approx(vp["reference_loss"], rel=1e-5)
        # the integer bookkeeping that spans the vocabulary (an id -> column map per step)
        print(f"rank {r['rank']}: vocabulary-long integer tensors per step: {vp['int_wider']}")


def test_the_recorder_catches_planted_full_logits(measured):
    for r in measured:
        planted = r["planted"]
        shapes = {shape for _, shape, _ in planted["float_wider"]}
        assert (tokens_of(r["rank"]), VOCAB) in shapes, sorted(shapes)  # the (T, V) logits
        assert (VOCAB, DIM) in shapes  # and the gathered table
        # the full-table path trains the same model to the same losses
        assert planted["losses"] == pytest.approx(r["vocab_parallel"]["losses"], rel=1e-5)
