"""``--embrace-plan`` under fairseq-train: every plan the planner can choose trains as
stock (same per-update loss and gradient norm), on 2 and 3 ranks; a checkpoint saved
under one plan resumes under another; a plan that cannot hold stops at start-up with
the reason. The tests elsewhere pin ``EMBRACE_PLAN=shard`` (tests/conftest.py); these
name their plan."""
from __future__ import annotations

import shutil

import pytest

from fairseq_corpus import run_fairseq_tool_each
from test_fairseq_plugin import (COMMON, REL, SCHEDULED, TINY_MT, _assert_same, _train, lm_data,  # noqa: F401
                                 mt_data)

UPDATES = 8
HALF = UPDATES // 2
UNTIED = ["--clip-norm", "0.05"]
MIXED = "encoder.embed_tokens=row-shard,decoder.output_projection=vocab-parallel"


def _plan(plan):
    return ["--embrace-plan", plan]


def _losses(run):
    return {int(r["num_updates"]): float(r["loss"]) for r in run.updates}


def test_auto_plan_trains_as_stock_and_says_so(mt_data, tmp_path):
    """2 ranks, untied tables: auto decides from the measured rates (on this tiny CPU model
    it replicates, the stock path), logs one line per table and one for the whole."""
    stock = _train(mt_data, "transformer", tmp_path / "stock", 2, UNTIED)
    ours = _train(mt_data, "embrace_transformer", tmp_path / "ours", 2, [*UNTIED, *_plan("auto")])
    _assert_same(stock, ours, "auto x2")
    lines = [line for line in ours.output.splitlines() if "EmbRace plan" in line]
    assert len(lines) == 4, lines  # three tables and the whole
    assert any("decoder.output_projection 56 x 16:" in line for line in lines)
    assert "(auto, 2 ranks)" in lines[-1] and "predicted step" in lines[-1]
    assert "(a timed step of the stock model)" in lines[-1], lines[-1]  # not the matrix-product fallback
    # what planning cost at start-up (the probe included) is said, and is seconds at most
    planned = float(lines[-1].split("planned in ")[1].split(" s")[0])
    assert 0 < planned < 5.0, lines[-1]
    assert (SCHEDULED in ours.output) == any("row-shard" in x or "vocab-parallel" in x for x in lines[:-1])


def test_mixed_plan_on_three_ranks_resumes_under_another_plan(mt_data, tmp_path):
    """3 ranks (56 rows: uneven shards): encoder table row-sharded, decoder table
    replicated, output projection vocab-parallel, as stock; its checkpoint at update 4
    resumed with every table replicated repeats stock's updates 5..8."""
    extra = [*UNTIED, "--save-interval-updates", str(HALF)]
    stock = _train(mt_data, "transformer", tmp_path / "stock", 3, extra)
    mixed = _train(mt_data, "embrace_transformer", tmp_path / "mixed", 3, [*extra, *_plan(MIXED)], max_update=HALF)
    assert SCHEDULED in mixed.output
    assert "decoder.embed_tokens 56 x 16: replicate" in mixed.output
    want = _losses(stock)
    got = _losses(mixed)
    assert sorted(got) == list(range(1, HALF + 1))
    for k, v in got.items():
        assert abs(v - want[k]) <= REL * abs(want[k]), (k, v, want[k])
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "mixed" / f"checkpoint_1_{HALF}.pt", resumed_dir / "checkpoint_last.pt")
    resumed = _train(mt_data, "embrace_transformer", resumed_dir, 3, [*extra, *_plan("replicate")])
    assert SCHEDULED not in resumed.output  # every table replicated: fairseq's own wrapper
    again = _losses(resumed)
    assert sorted(again) == list(range(HALF + 1, UPDATES + 1))
    for k, v in again.items():
        assert abs(v - want[k]) <= REL * abs(want[k]), (k, v, want[k])


def test_a_plan_that_cannot_hold_stops_with_the_reason(mt_data, tmp_path):
    runs = run_fairseq_tool_each("fairseq-train", [
        [str(mt_data), "--task", "translation", "--arch", "embrace_transformer", *TINY_MT, "--cpu", "--optimizer",
         "adam", "--lr", "0.001", "--max-tokens", "120", "--max-update", "1", "--save-dir", str(tmp_path / str(i)),
         *flags] for i, flags in enumerate([
             ["--adaptive-softmax-cutoff", "20", "--criterion", "adaptive_loss", *_plan(
                 "output_projection=vocab-parallel")],
             _plan("decoder.embed_tokens=sideways"),
         ])], check=False)
    for run, message in zip(runs, ["decoder.output_projection=vocab-parallel cannot hold: its output layer is not "
                                   "a plain projection", "the choice must be one of"]):
        assert run.returncode != 0 and message in run.output, run.output[-3000:]
        assert not run.updates


@pytest.mark.slow
@pytest.mark.parametrize("nproc,plan", [(3, "replicate"), (3, "decoder.embed_tokens=row-shard"), (2, "auto")])
def test_lm_tied_plans_train_as_stock(lm_data, tmp_path, nproc, plan):
    """The LM with its table tied to the output layer, under each plan, on 2 and 3 ranks."""
    extra = ["--share-decoder-input-output-embed", "--clip-norm", "0.05"]
    stock = _train(lm_data, "transformer_lm", tmp_path / "stock", nproc, extra, "language_modeling")
    ours = _train(lm_data, "embrace_transformer_lm", tmp_path / "ours", nproc, [*extra, *_plan(plan)],
                  "language_modeling")
    _assert_same(stock, ours, f"lm x{nproc} {plan}")
