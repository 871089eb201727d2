"""The planner's compute probe on each fairseq family: the stock model's forward and
backward are timed on a made-up batch of the run's shape (not priced from a matrix
product), the dense parameters are counted from that model, and the global random
stream is left as it was (the model built after the probe draws as stock's)."""
from __future__ import annotations

import copy

import pytest
import torch
from fairseq.models import ARCH_MODEL_REGISTRY

from embrace_fairseq.fairseq_adapter import table_plan as TP
from rank_fns_dropin import Dictionaries, parsed_args

#: architecture -> (how it is run, its tables as the adapter lists them)
CASES = {
    "embrace_transformer": (TP.TRANSLATION, TP.translation_tables),
    "embrace_bart_base": (TP.TRANSLATION, TP.translation_tables),
    "embrace_transformer_lm": (TP.LM, TP.lm_tables),
    "embrace_roberta": (TP.MASKED_LM, TP.roberta_tables),
}


def _config(arch):
    args = copy.deepcopy(parsed_args(arch, ()))
    dc = getattr(ARCH_MODEL_REGISTRY[arch], "__dataclass", None)
    return dc.from_namespace(args) if dc is not None else args


@pytest.mark.parametrize("arch", list(CASES))
def test_compute_is_a_timed_step_of_the_stock_model(arch):
    kind, tables_of = CASES[arch]
    cfg, task = _config(arch), Dictionaries()
    tables = tables_of(cfg, task)
    stock_cls = ARCH_MODEL_REGISTRY[arch[len("embrace_"):]]
    torch.manual_seed(5)
    before = torch.get_rng_state()
    dense, rates = TP._probe(cfg, task, stock_cls, kind, tables, None, torch.float32, 1)
    assert torch.equal(torch.get_rng_state(), before)  # the model's own draws stay as stock's
    assert rates.compute_from == "step" and rates.compute_s > 0, rates
    stock = stock_cls.build_model(copy.deepcopy(cfg), task)
    assert dense == sum(p.numel() for p in stock.parameters()) - sum(t.numel for t in tables)


def test_an_unknown_kind_falls_back_to_the_matrix_product(caplog):
    cfg, task = _config("embrace_transformer"), Dictionaries()
    tables = TP.translation_tables(cfg, task)
    _, rates = TP._probe(cfg, task, ARCH_MODEL_REGISTRY["transformer"], "speech", tables, None, torch.float32, 1)
    assert rates.compute_from == "flops" and rates.compute_s > 0
    assert "could not be timed" in caplog.text and "speech" in caplog.text
