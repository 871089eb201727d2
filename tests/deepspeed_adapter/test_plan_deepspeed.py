"""``"embrace": {"plan": ...}`` under embrace-ds-train: the same planner as
``--embrace-plan``; every plan trains as stock fairseq-train (per-update losses within
1e-4) on 2 and 3 ranks; a bad plan stops at start-up with the key named."""
import json

import pytest

pytest.importorskip("deepspeed")

from fairseq_corpus import run_ds_train, run_fairseq_train  # noqa: E402
from test_ds_fairseq_loop import PRECISION, STOCK_FLAGS, TINY_MT, _assert_same_run, mt_data  # noqa: E402,F401

from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError, parse_embrace_config  # noqa: E402

UNTIED_MT = [a for a in TINY_MT if a != "--share-all-embeddings"]
MIXED = "encoder.embed_tokens=row-shard,decoder.output_projection=vocab-parallel"


def _ds_json(tmp_path, plan):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0},
                                "embrace": {"piece_bytes": 4096, "bucket_bytes": 16384, "plan": plan}}))
    return path


def test_plan_key_is_validated():
    assert parse_embrace_config({"plan": "auto"}).plan == "auto"
    assert parse_embrace_config({"plan": MIXED}).plan == MIXED
    assert parse_embrace_config({}).plan is None
    for bad, message in ((3, "must be null, one of"), ("embed_tokens=sideways", "the choice must be one of"),
                         ("row-shard", "is not table=choice")):
        with pytest.raises(EmbraceConfigError, match=message):
            parse_embrace_config({"plan": bad})


def _pair(data, tmp_path, nproc, plan):
    stock = run_fairseq_train([str(data), *UNTIED_MT, "--arch", "transformer", "--save-dir", str(tmp_path / "stock"),
                               *STOCK_FLAGS], nproc=nproc, env=PRECISION, timeout=600).check()
    ds = run_ds_train(data, [*UNTIED_MT, "--arch", "embrace_transformer", "--save-dir", str(tmp_path / "ds")],
                      _ds_json(tmp_path, plan), nproc=nproc, launcher="torchrun", env=PRECISION).check()
    _assert_same_run(stock, ds)
    return ds


def test_mixed_plan_under_deepspeed_equals_stock(mt_data, tmp_path):
    """2 ranks: encoder table row-sharded, decoder table replicated, output vocab-parallel."""
    ds = _pair(mt_data, tmp_path, 2, MIXED)
    assert "decoder.embed_tokens" in ds.output and ": replicate" in ds.output, ds.output[-3000:]
    assert "encoder.embed_tokens" in ds.output and ": row-shard" in ds.output


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["auto", "replicate", MIXED])
def test_plans_under_deepspeed_on_three_ranks_equal_stock(mt_data, tmp_path, plan):
    ds = _pair(mt_data, tmp_path, 3, plan)
    assert "EmbRace plan (" in ds.output
