"""Drop-in at the Python level: a script reaching into an EmbRace model by attribute finds
what it finds on the stock model.

For every registered ``embrace_*`` architecture (read from fairseq's registry, each built
beside its stock architecture from the same parsed arguments), tied and untied, with each
``--embrace-output`` mode, on a world of one and on 2 and 3 gloo ranks (a 29-row table:
uneven shards): every name of the stock model's ``named_parameters(remove_duplicate=False)``
resolves by attribute to a parameter; the names that share one parameter on the stock model
share one here, and no others; ``named_parameters()`` and ``state_dict()`` list the stock
keys in the stock order; a sharded table answers with this rank's rows (marked
``embrace_sharded``) and its holder's ``full_weight()`` equals the stock table; a state dict
of unconsolidated shards stops naming both calls; stock state dicts load strictly (also
without the tied output layer's second key) and this one loads strictly into the stock model.
The expected names and groups come from the stock model each time (tests/harness/rank_fns_dropin.py).
"""
from __future__ import annotations

import pytest
import torch

from embrace_fairseq.tools.local_ranks import run_ranks
from rank_fns_dropin import OUTPUT_MODES, build_pair, cases, check_cases, embrace_architectures, kind_of

ARCHS = embrace_architectures()


def _assert_clean(results):
    problems = {f"rank {rank}: {case}": p for rank, res in enumerate(results) for case, p in res.items() if p}
    assert not problems, "\n".join(f"{case}: {p}" for case, p in problems.items())


def test_registry_has_every_family():
    # the test covers whatever is registered; this guards against an empty or partial registry
    assert {kind_of(a) for a in ARCHS} == {"translation", "lm", "roberta", "bart"}
    assert {"embrace_transformer", "embrace_transformer_lm", "embrace_roberta", "embrace_xlm",
            "embrace_bart_base", "embrace_mbart_large"} <= set(ARCHS)


def test_reported_attribute_path():
    """The path scripts use on RoBERTa: the tied output weight is the token table's
    parameter, and stays so through a conversion (--fp16 halves the model)."""
    stock, ours = build_pair("embrace_roberta", (), "auto")
    assert stock.encoder.lm_head.weight is stock.encoder.sentence_encoder.embed_tokens.weight
    table = ours.encoder.sentence_encoder.embed_tokens
    assert ours.encoder.lm_head.weight is table.weight
    ours.half()
    assert ours.encoder.lm_head.weight is table.weight and table.weight.dtype == torch.float16
    assert list(ours.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("arch", ARCHS)
def test_world_of_one(arch):
    # one output mode per tie variant, in turn: on one rank the mode changes no module
    _assert_clean([check_cases(0, 1, cases([arch], rotate=0))])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks(world):
    """Every architecture and tie variant on real gloo ranks, the output modes taken in
    turn (each world from another one on: together they cover two thirds of the matrix)."""
    _assert_clean(run_ranks(check_cases, world, cases(ARCHS, rotate=world), timeout_s=600))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_every_mode(world):
    _assert_clean(run_ranks(check_cases, world, cases(ARCHS, OUTPUT_MODES), timeout_s=900))
