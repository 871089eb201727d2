"""The planner's cost model and enumerator: pure arithmetic, no ranks."""
from __future__ import annotations

import pytest

from embrace_fairseq.planner.cost import REPLICATE, ROW_SHARD, VOCAB_PARALLEL, step_cost, stock_cost
from embrace_fairseq.planner.inputs import INPUT, OUTPUT, TIED, PlanInputs, Rates, TableInput
from embrace_fairseq.planner.plan import (SCHEDULE_SIZES, SHARD_MARGIN, PlanError, choose, explicit, explicit_choices,
                                          resolve)

FLOPS = 30e12  # a V100-class GPU's sustained rate, as the simulator's projection assumes


def _inputs(tables, dense, tokens, n, gbit, rpn=8, flops=FLOPS, output_mode="auto"):
    out = sum(t.numel * t.output_tokens_per_rank for t in tables if t.is_output)
    compute = 6 * (dense * tokens + out) / flops
    return PlanInputs(tuple(tables), dense, n, rpn if n >= rpn else 1, Rates(gbit * 1e9 / 8, 10e-6, compute),
                      element_size=2, id_size=4, output_mode=output_mode)


def xlmr(n, gbit=25):  # untied-from-nothing large vocabulary: 250,002 x 768, tied to the head
    table = TableInput("embed_tokens", 250_002, 768, TIED, lookups_per_rank=8192, output_tokens_per_rank=1229)
    return _inputs([table], 85_000_000, 8192, n, gbit)


def transformer_base(n, gbit=100):
    table = TableInput("embed_tokens", 32_768, 512, TIED, lookups_per_rank=7000, output_tokens_per_rank=3500)
    return _inputs([table], 44_000_000, 3500, n, gbit)


def untied_large(n, gbit=25):
    return _inputs([TableInput("encoder.embed_tokens", 250_002, 1024, INPUT, lookups_per_rank=4096),
                    TableInput("decoder.embed_tokens", 250_002, 1024, INPUT, lookups_per_rank=4096),
                    TableInput("output_projection", 250_002, 1024, OUTPUT, output_tokens_per_rank=4096)],
                   200_000_000, 4096, n, gbit)


@pytest.mark.parametrize("n", [8, 16, 32, 64])
def test_large_vocabulary_chooses_row_shard(n):
    plan = choose(xlmr(n))
    assert plan.choice("embed_tokens") == ROW_SHARD
    assert plan.speedup > 1.1


@pytest.mark.parametrize("n", [16, 32, 64])
def test_transformer_base_on_fast_links_replicates(n):
    plan = choose(transformer_base(n))
    assert plan.choices == (("embed_tokens", REPLICATE),) and not plan.schedule
    assert plan.speedup == pytest.approx(1.0)


def test_untied_large_vocabulary_shards_every_table():
    plan = choose(untied_large(16))
    assert dict(plan.choices) == {"encoder.embed_tokens": ROW_SHARD, "decoder.embed_tokens": ROW_SHARD,
                                  "output_projection": VOCAB_PARALLEL}


@pytest.mark.parametrize("make", [xlmr, transformer_base, untied_large])
@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_chosen_plan_is_never_predicted_slower_than_replicating_everything(make, n):
    inputs = make(n)
    plan = choose(inputs)
    assert plan.predicted.step_s <= stock_cost(inputs).step_s
    for spec in ("shard", "replicate"):  # and within the margin of either fixed plan
        assert plan.predicted.step_s <= explicit(inputs, spec).predicted.step_s * (1 + SHARD_MARGIN)


def test_world_of_one_replicates_everything():
    plan = choose(untied_large(1))
    assert not plan.sharded and not plan.schedule


def test_replicate_all_is_the_stock_step_and_sharding_moves_fewer_bytes():
    inputs = xlmr(16)
    stock = stock_cost(inputs)
    assert step_cost(inputs, {"embed_tokens": REPLICATE}).step_s == stock.step_s
    sharded = step_cost(inputs, {"embed_tokens": ROW_SHARD})
    assert sharded.table_bytes["embed_tokens"] < stock.table_bytes["embed_tokens"] / 5
    # the stock table's bytes are its ring all-reduce: 2 (N-1)/N V D e
    assert stock.table_bytes["embed_tokens"] == pytest.approx(2 * 15 / 16 * 250_002 * 768 * 2)


def test_slower_link_makes_sharding_pay_more():
    assert choose(xlmr(16, gbit=10)).speedup > choose(xlmr(16, gbit=100)).speedup


def test_explicit_plans_match_by_name_suffix_and_refuse_what_cannot_hold():
    inputs = untied_large(4)
    assert explicit_choices(inputs, "embed_tokens=row-shard") == {
        "encoder.embed_tokens": ROW_SHARD, "decoder.embed_tokens": ROW_SHARD, "output_projection": REPLICATE}
    with pytest.raises(PlanError, match="no table 'lm_head'"):
        explicit_choices(inputs, "lm_head=row-shard")
    with pytest.raises(PlanError, match="must be one of"):
        explicit_choices(inputs, "output_projection=sideways")
    with pytest.raises(PlanError, match="is not table=choice"):
        explicit_choices(inputs, "row-shard")
    adaptive = _inputs([TableInput("decoder.embed_tokens", 1000, 16, INPUT, lookups_per_rank=64),
                        TableInput("output_projection", 1000, 16, OUTPUT, output_tokens_per_rank=64,
                                   plain_output=False)], 10_000, 64, 2, 10)
    with pytest.raises(PlanError, match="not a plain projection"):
        explicit_choices(adaptive, "output_projection=vocab-parallel")
    assert choose(adaptive).choice("output_projection") == REPLICATE


def test_start_up_lines_name_every_table_and_the_whole():
    inputs = xlmr(16)
    plan = resolve(inputs, "auto")
    lines = plan.lines(inputs)
    assert len(lines) == 2
    assert lines[0].startswith("EmbRace plan: embed_tokens 250,002 x 768: row-shard, ")
    assert "instead of 720.0 MB" in lines[0]
    assert f"{plan.speedup:.2f}x" in lines[1] and "auto, 16 ranks" in lines[1]


def test_a_gain_inside_the_margin_keeps_the_stock_step():
    inputs = transformer_base(8, gbit=25)
    sharded = min((step_cost(inputs, {"embed_tokens": ROW_SHARD}, True, b, p) for b, p in SCHEDULE_SIZES),
                  key=lambda c: c.step_s)
    stock = stock_cost(inputs)
    assert stock.step_s / (1 + SHARD_MARGIN) < sharded.step_s < stock.step_s  # sharding would win a little
    assert not choose(inputs).sharded
    for make in (xlmr, untied_large):  # a chosen sharded plan clears the margin
        plan = choose(make(16))
        assert plan.sharded and plan.predicted.step_s * (1 + SHARD_MARGIN) <= plan.stock.step_s


def test_schedule_off_holds_under_auto_and_the_record_keeps_the_inputs():
    """``--embrace-schedule off`` is not overridden by ``auto``: the plan still shards where
    that pays, with the schedule off; ``on`` lets the plan pick it and its sizes."""
    inputs = xlmr(16)
    free, held = resolve(inputs, "auto", schedule=True), resolve(inputs, "auto", schedule=False)
    assert free.schedule and (free.bucket_bytes, free.piece_bytes) in SCHEDULE_SIZES
    assert not held.schedule and held.choice("embed_tokens") == ROW_SHARD
    assert held.predicted.step_s >= free.predicted.step_s
    rec = free.record()
    assert rec["spec"] == "embed_tokens=row-shard" and rec["predicted_step_s"] == free.predicted.step_s
    assert rec["inputs"]["world_size"] == 16 and rec["inputs"]["rates"]["compute_s"] == inputs.rates.compute_s
    assert free.lines() == free.lines(inputs)


def test_vocab_parallel_bias_gather_is_priced():
    """RoBERTa's LM head bias read vocab-parallel: its gradient's rows all-gathered in the
    backward, (N-1)/N of V elements a rank, priced in bytes and time; gathered, nothing."""
    from dataclasses import replace

    from embrace_fairseq.core.ring_volume import ring_allgather_bytes
    from embrace_fairseq.planner.cost import table_traffic

    plain = xlmr(8)
    table = plain.tables[0]
    biased = replace(plain, tables=(replace(table, output_bias=True),))
    vp_plain, vp_bias = (table_traffic(i, i.tables[0], VOCAB_PARALLEL) for i in (plain, biased))
    assert vp_bias.sent_bytes - vp_plain.sent_bytes == pytest.approx(ring_allgather_bytes(8 * 31_251 * 2, 8))
    assert vp_bias.backward_s > vp_plain.backward_s
    gather = replace(biased, output_mode="gather")
    assert table_traffic(gather, gather.tables[0], ROW_SHARD).sent_bytes == \
        table_traffic(replace(plain, output_mode="gather"), table, ROW_SHARD).sent_bytes
