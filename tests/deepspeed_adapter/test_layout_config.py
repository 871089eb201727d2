"""The table keys of the DeepSpeed "embrace" section ("shard_layout", "exchange",
"ranks_per_node"): validated, applied to the tables when the hook attaches (and to the
model embrace-ds-train builds), and training under either layout equals the replicated
reference."""
import argparse

import pytest
import torch

from embrace_fairseq.deepspeed_adapter import EmbraceConfigError, initialize, parse_embrace_config
from embrace_fairseq.deepspeed_adapter.fairseq_options import FairseqOptionConflict
from embrace_fairseq.deepspeed_adapter.train import apply_table_keys
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_deepspeed as D
import rank_fns_layouts as fns


def test_shard_layout_parses():
    assert parse_embrace_config({}).shard_layout is None
    assert parse_embrace_config({"shard_layout": "contiguous"}).shard_layout == "contiguous"
    assert parse_embrace_config({"shard_layout": "strided"}).shard_layout == "strided"
    assert parse_embrace_config({"shard_layout": None}).shard_layout is None


@pytest.mark.parametrize("value", ["rows", 1, True, ""])
def test_bad_shard_layout_stops_startup(value):
    cfg = {"train_micro_batch_size_per_gpu": 1, "embrace": {"shard_layout": value}}
    with pytest.raises(EmbraceConfigError, match='"embrace.shard_layout" must be null or one of .strided., .contiguous.'):
        initialize(model=torch.nn.Linear(2, 2), config=cfg)


def _apply(args, argv, **section):
    apply_table_keys(args, argv, parse_embrace_config(section))


def test_json_layout_reaches_the_fairseq_args():
    args = argparse.Namespace(embrace_shard_layout="strided")  # the flag's default
    _apply(args, ["data", "--arch", "embrace_transformer"], shard_layout="contiguous")
    assert args.embrace_shard_layout == "contiguous"
    same = argparse.Namespace(embrace_shard_layout="contiguous")
    _apply(same, ["--embrace-shard-layout", "contiguous"], shard_layout="contiguous")
    keep = argparse.Namespace(embrace_shard_layout="contiguous")
    _apply(keep, ["--embrace-shard-layout=contiguous"])
    assert keep.embrace_shard_layout == "contiguous"
    with pytest.raises(FairseqOptionConflict, match="--embrace-shard-layout 'strided' disagrees"):
        _apply(argparse.Namespace(embrace_shard_layout="strided"), ["--embrace-shard-layout", "strided"],
               shard_layout="contiguous")


def test_json_exchange_reaches_the_fairseq_args():
    args = argparse.Namespace(embrace_exchange="auto", embrace_ranks_per_node=None)
    _apply(args, ["data"], exchange="flat", ranks_per_node=2)
    assert (args.embrace_exchange, args.embrace_ranks_per_node) == ("flat", 2)
    with pytest.raises(FairseqOptionConflict, match="--embrace-exchange 'node' disagrees"):
        _apply(argparse.Namespace(embrace_exchange="node"), ["--embrace-exchange=node"], exchange="flat")
    for key, bad in (("exchange", "ring"), ("ranks_per_node", 0), ("ranks_per_node", True)):
        with pytest.raises(EmbraceConfigError, match=f'"embrace.{key}" must be null or'):
            parse_embrace_config({key: bad})


def test_config_layout_reshards_tables_and_trains_as_replicated():
    world = 2
    res = run_ranks(fns.deepspeed_layouts_run, world, 3, timeout_s=300, pg_timeout_s=120)
    for rank, r in enumerate(res):
        ref = r["ref"]
        for i, (built, embrace, want) in enumerate(fns.VARIANTS):
            got, where = r[i], (built, embrace, rank)
            assert got["layout"] == want, where
            if want == "strided":
                assert got["owned"] == list(range(rank, D.VOCAB, world)), where
            assert D.rel_diff(got["losses"], ref["losses"]) < 1e-5, where
            for name, value in ref["state"].items():
                assert D.rel_diff(got["state"][name], value) < 1e-5, (where, name)
