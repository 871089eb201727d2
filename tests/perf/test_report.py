"""The benchmark report from ranks' records: hand-made records, figures checked by hand."""
from types import SimpleNamespace

import pytest
import torch

from embrace_fairseq.perf.bench.report import assemble, markdown

VOCAB, DIM, DENSE = 10, 4, 100
# two ranks, one step, the default (strided) layout: id v lives on rank v % 2, so rank 0
# asks for id 7 (rank 1's) and rank 1 for id 6 (rank 0's)
IDS = {0: torch.tensor([0, 2, 4, 7]), 1: torch.tensor([3, 5, 6])}


def _rank_record(rank, step_s, by_kind, loss):
    strat = lambda s, b, l: {"step_s": s, "loss": l, "bytes_by_kind": b, "counted_bytes_by_op": {},  # noqa: E731
                             "wire_bytes_per_step": None, "tokens": 10, "batch_steps": [0, 1]}
    rec = {"links": [{"link": {"gbit": 1.0, "latency_ms": 0.1}, "strategies": {
        "fairseq_legacy_ddp": strat(step_s["fairseq_legacy_ddp"], {"dense_allreduce": 560.0}, loss),
        "embrace_schedule": strat(step_s["embrace_schedule"], by_kind, [x * (1 + 1e-4) for x in loss]),
    }}]}
    if rank == 0:
        rec["compute_profile"] = {"vocab": VOCAB, "dim": DIM, "dense_numel": DENSE,
                                  "dense_layers": [{"name": "l", "numel": DENSE}],
                                  "compute_s": {"forward": 0.1, "backward": 0.2, "optimizer": 0.05}}
    return rec


def _result():
    embrace_bytes = {"counts": 4.0, "ids": 4.0, "rows": 16.0, "grad_rows": 16.0, "dense_grad": 400.0}
    ranks = [_rank_record(0, {"fairseq_legacy_ddp": [1.0, 3.0], "embrace_schedule": [0.5, 0.5]}, embrace_bytes,
                          [2.0, 1.0]),
             _rank_record(1, {"fairseq_legacy_ddp": [2.0, 1.0], "embrace_schedule": [0.25, 1.5]}, embrace_bytes,
                          [2.0, 1.0])]
    batches = SimpleNamespace(workload=SimpleNamespace(model_args=[], is_masked_lm=False, tables=("decoder.embed_tokens.weight",)),
                              ids=lambda step, rank: IDS[rank], table_ids=lambda step, rank: [IDS[rank]],
                              target_tokens=lambda step, rank: 5)
    meta = {"mode": "quick", "command": "test", "wall_s": 1.0, "versions": {}, "fallback_loopback": True,
            "fallback_reason": "test", "machine": {"cpus": 2, "load_at_start": [0.0]},
            "schedule": {"warmup": 0, "rounds": 1, "steps_per_round": 2, "interleaving": "-"}}
    return assemble(meta, [{"model": "toy", "world_size": 2, "ranks": ranks}], {("toy", 2): batches}, True)


def test_assemble_by_hand():
    res = _result()
    runs = {r["strategy"]: r for r in res["runs"]}
    ddp, e = runs["fairseq_legacy_ddp"], runs["embrace_schedule"]
    # a step takes as long as its slowest rank: ddp [2, 3], (e) [0.5, 1.5]
    assert ddp["step_s"] == [2.0, 3.0] and e["step_s"] == [0.5, 1.5]
    assert ddp["median_step_s"] == 2.5 and e["median_step_s"] == 1.0
    # the geometric mean of the paired ratios 2 / 0.5 and 3 / 1.5
    assert res["ratios"] == {"toy/w2/1gbit_0.1ms": {"fairseq_legacy_ddp": pytest.approx(8 ** 0.5)}}
    assert e["tokens_per_s"] == 20 / 2.0  # both ranks' tokens over the summed step times
    # the analytic minimum of the hand count in test_bounds: 560 bytes all-reduced, 440 exchanged
    assert ddp["min_bytes_per_rank_per_step"] == 560.0 and ddp["bytes_over_min"] == 1.0
    assert e["min_bytes_per_rank_per_step"] == 440.0 and e["bytes_over_min"] == 1.0
    assert res["profiles"]["toy"]["unique_ids_per_rank"] == {"2": [4.0, 3.0]}
    assert res["profiles"]["toy"]["tokens_per_rank"] == 5  # 20 tokens over 2 ranks and 2 steps
    drift = res["loss_max_rel_diff_vs_legacy_ddp"]["toy/w2/1gbit_0.1ms"]
    assert drift["fairseq_legacy_ddp"] == 0.0 and drift["embrace_schedule"] == pytest.approx(1e-4)
    assert "bounds_errors" not in res["meta"]


def test_markdown_lists_every_run_with_its_label():
    md = markdown(_result(), ["x.png"])
    # the geometric mean of the paired ratios 2/0.5 and 3/1.5 with its t interval on their
    # logs (1 degree of freedom at 2 steps: very wide)
    from embrace_fairseq.perf.bench.stats import log_t_interval

    iv = log_t_interval([2.0, 3.0], [0.5, 1.5])
    assert "| (a) fairseq legacy_ddp | 2.500 |" in md and f"| 2.83x [{iv['low']:.2f}, {iv['high']:.2f}] |" in md
    assert "| (e) EmbRace, 2D schedule | 1.000 |" in md and "bytes/min" in md
    assert md.index("(a) fairseq legacy_ddp") < md.index("(e) EmbRace")  # registry order
    assert "![x.png](x.png)" in md and "FALLBACK" in md


def test_two_tables_add_their_minimums_and_count_the_dense_layers_once():
    """An encoder table and a decoder table (no sharing): each its own exchange, the
    dense parameters all-reduced once; the stock all-reduce moves both tables."""
    from embrace_fairseq.perf.bounds import min_bytes_per_step

    dec_vocab, dec_ids = 12, {0: torch.tensor([1, 11]), 1: torch.tensor([1, 10, 3])}
    ranks = [_rank_record(r, {"fairseq_legacy_ddp": [1.0, 1.0], "embrace_schedule": [1.0, 1.0]}, {"rows": 1.0},
                          [2.0, 1.0]) for r in range(2)]
    ranks[0]["compute_profile"]["tables"] = [{"name": "encoder.embed_tokens.weight", "vocab": VOCAB, "dim": DIM},
                                             {"name": "decoder.embed_tokens.weight", "vocab": dec_vocab, "dim": DIM}]
    batches = SimpleNamespace(
        workload=SimpleNamespace(model_args=[], is_masked_lm=False, tables=("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")),
        ids=lambda step, rank: torch.cat([IDS[rank], dec_ids[rank] + VOCAB]),
        table_ids=lambda step, rank: [IDS[rank], dec_ids[rank]], target_tokens=lambda step, rank: 5)
    meta = {"mode": "quick", "command": "test", "wall_s": 1.0, "versions": {}, "fallback_loopback": True,
            "fallback_reason": "test", "machine": {"cpus": 2, "load_at_start": [0.0]},
            "schedule": {"warmup": 0, "rounds": 1, "steps_per_round": 2, "interleaving": "-"}}
    res = assemble(meta, [{"model": "toy2", "world_size": 2, "ranks": ranks}], {("toy2", 2): batches}, True)
    runs = {r["strategy"]: r for r in res["runs"]}

    def table_min(name, vocab, ids, dense):
        return min_bytes_per_step(name, world_size=2, vocab=vocab, dim=DIM, dense_numel=dense,
                                  ids_per_rank=[ids[0], ids[1]])["total"]

    e = runs["embrace_schedule"]["min_bytes_per_rank_per_step"]
    assert e == 440.0 + table_min("embrace_schedule", dec_vocab, dec_ids, 0)
    # decoder table, strided: rank 0's ids 1 and 11 are rank 1's, rank 1's id 10 is rank 0's
    assert table_min("embrace_schedule", dec_vocab, dec_ids, 0) > 0
    ddp = runs["fairseq_legacy_ddp"]["min_bytes_per_rank_per_step"]
    assert ddp == 560.0 + dec_vocab * DIM * 4  # ring all-reduce at 2 ranks: the payload once
    assert res["profiles"]["toy2"]["unique_ids_per_rank"] == {"2": [6.0, 6.0]}


def test_report_lists_each_strategy_with_its_settings():
    md = markdown(_result(), [])
    assert "## Strategies and their settings" in md
    assert "--ddp-backend legacy_ddp" in md and "2D schedule (4 MB buckets, 1 MB pieces" in md
