"""Cross-iteration overlap under the DeepSpeed hook (``"next_forward": true``), in real
gloo ranks: the step leaves the dense all-reduce running and each layer is updated when
the next forward reaches it; training equals stock DeepSpeed (2 and 3 ranks, tied and
untied) and the same EmbRace model without it (fairseq's tied Transformer shaped as BART,
an AdamW whose learning rate changes every step); with gradient clipping it falls back."""
import os

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("fairseq")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_next_forward as R  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402

RTOL = 1e-5


_TWO_RANKS = []


def _two_ranks():
    """The 2-rank tiny models and the Transformer in one spawned run, shared by both tests."""
    if not _TWO_RANKS:
        _TWO_RANKS.append(run_ranks(R.tiny_and_transformer, 2, timeout_s=300, pg_timeout_s=120))
    return _TWO_RANKS[0]


# 2 ranks and 3 (an odd world)
@pytest.mark.parametrize("world", [2, 3])
def test_same_training_as_stock_deepspeed(world):
    runs = [r["tiny"] for r in _two_ranks()] if world == 2 else run_ranks(R.tiny, world, timeout_s=300,
                                                                            pg_timeout_s=120)
    for rank, res in enumerate(runs):
        for tied in (False, True):
            ref, got = res[("stock", tied)], res[("next_forward", tied)]
            assert got["next_forward"], "no clipping, fp32, torch Adam: the overlap applies"
            assert R.D.rel_diff(got["losses"], ref["losses"]) < RTOL, (world, rank, tied, got["losses"], ref["losses"])
            for name in ref["state"]:
                assert R.D.rel_diff(got["state"][name], ref["state"][name]) < RTOL, (world, rank, tied, name)
        # gradient clipping needs every gradient first: the overlap falls back
        assert not res[("clipped", True)]["next_forward"]


def test_transformer_layers_are_updated_inside_the_next_forward():
    results = [r["transformer"] for r in _two_ranks()]
    for rank, res in enumerate(results):
        ref, got = res[False], res[True]
        assert got["active"] and not ref["active"]
        assert R.D.rel_diff(got["losses"], ref["losses"]) < RTOL, (rank, got["losses"], ref["losses"])
        for name in ref["state"]:
            assert R.D.rel_diff(got["state"][name], ref["state"][name]) < RTOL, (rank, name)
        # every encoder and decoder layer is hooked, and so is every layer norm and learned
        # position table outside them (BART's); nothing is left for the model's start
        hooked = set(got["layers"])
        assert {f"encoder.layers.{i}" for i in range(3)} <= hooked and "decoder.layers.0" in hooked, hooked
        outside = {f"{side}.{m}" for side in ("encoder", "decoder")
                   for m in ("layer_norm", "layernorm_embedding", "embed_positions")}
        assert outside <= hooked and "" not in hooked, hooked
        # from the second forward on, updates happen inside the forward (not at its start only)
        assert got["in_forward"][0] == 0 and all(k > 0 for k in got["in_forward"][1:]), got["in_forward"]
        forwards = sorted(e["ts"] for e in got["events"] if e["name"] == "forward")
        updates = [e for e in got["events"] if e["name"] == "next_forward_update" and e["args"]["in_forward"]]
        assert len(updates) >= (R.STEPS - 1) * 2
        # each update lies inside a forward phase
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in got["events"] if e["name"] == "forward"]
        assert all(any(a <= u["ts"] <= b for a, b in spans) for u in updates), (forwards[:3], updates[:3])
