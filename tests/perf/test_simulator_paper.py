"""The 8-64 GPU projection: every stock baseline (ZeRO-1/2 included) and the floor, EmbRace
as built (strided shards, the automatic output path), and a latency term in every collective."""
import pytest

from embrace_fairseq.perf.simulator import Network, paper
from embrace_fairseq.perf.strategies import SPEEDUP_SUBJECT, get_strategy


@pytest.fixture(scope="module")
def study():
    return paper.paper_study(links_gbit=(25,), worlds=(8, 16, 64))


def test_every_stock_baseline_and_the_floor(study):
    base = study["assumptions"]["baselines"]
    assert {"fairseq_legacy_ddp", "fairseq_c10d", "deepspeed", "deepspeed_zero1", "deepspeed_zero2",
            "sparse_allgather"} <= set(base)
    assert not any(get_strategy(s).shards_table for s in base) and paper.FLOOR not in base
    for m in study["models"].values():
        for r in m["results"]:
            assert set(base) | {paper.FLOOR, SPEEDUP_SUBJECT} <= set(r["step_s"])
            assert r["best_baseline"] in base and r["slowest_baseline"] in base
            # nothing steps faster than the floor but what steps a shard of the optimizer state
            assert all(r["over_floor"][s] >= 1 - 1e-12 for s in ("fairseq_legacy_ddp", "deepspeed", "fairseq_c10d"))
    md = paper.markdown(study)
    header = next(line for line in md.splitlines() if line.startswith("| model | output | link |"))
    assert "| ZeRO-1 | ZeRO-2 |" in header and "(e) over floor" in header


def test_as_built_rows_state_the_automatic_output(study):
    tr = study["models"]["transformer_base_wmt_en_de"]["results"]
    lm = study["models"]["transformer_lm_wikitext103_267k"]["results"]
    # 3,500 target tokens per GPU and 32,768 ids: activations are cheaper while N x 3,500 < V
    out = {r["world_size"]: r["output"] for r in tr if r["variant"] == "as_built" and r["topology"] == "flat"}
    assert out == {8: "vocab_parallel", 16: "gather", 64: "gather"}
    for r in tr:
        b = r["output_bytes_per_rank"]
        assert r["output"] == ("vocab_parallel" if b["vocab_parallel"] < b["gather"] else "gather")
    assert all(r["output"] is None for r in lm)
    assert study["assumptions"]["shard_layout"] == "strided"
    # one what-if per model: contiguous shards, labelled as such
    assert {r["variant"] for r in tr} == {"as_built", "contiguous_shards"}
    assert "What-if (not built): contiguous shards" in paper.markdown(study)


def test_latency_raises_every_communicating_step():
    kw = dict(links_gbit=(25,), worlds=(16,), topologies=paper.TOPOLOGIES[:1])
    fast, slow = paper.paper_study(latency_s=0.0, **kw), paper.paper_study(latency_s=paper.PAPER_LATENCY_S, **kw)
    assert paper.PAPER_LATENCY_S > 0
    for name in fast["models"]:
        for r0, r1 in zip(fast["models"][name]["results"], slow["models"][name]["results"]):
            for s, t in r0["step_s"].items():
                if s == paper.FLOOR:
                    assert r1["step_s"][s] == t
                else:
                    assert r1["step_s"][s] > t, (name, s)
    md = paper.markdown(slow)
    assert "10 µs per message step" in md and "Topologies:" in md


def test_latency_in_every_collective():
    lat = 1e-3
    for kw in ({}, {"ranks_per_node": 4, "intra_gbit": 100.0}):
        with_lat, without = Network(10.0, latency_s=lat, **kw), Network(10.0, latency_s=0.0, **kw)
        n = 16
        assert with_lat.allreduce(1e6, n) - without.allreduce(1e6, n) == pytest.approx(2 * (n - 1) * lat)
        assert with_lat.allgather(1e6, n) - without.allgather(1e6, n) == pytest.approx((n - 1) * lat)
        assert with_lat.reduce_scatter(1e6, n) - without.reduce_scatter(1e6, n) == pytest.approx((n - 1) * lat)
        assert with_lat.alltoall(1e6, n) - without.alltoall(1e6, n) == pytest.approx((n - 1) * lat)
    # two levels on 4 nodes of 4: 2 (k-1) steps inside, 2 (m-1) across
    two = Network(10.0, latency_s=lat, ranks_per_node=4, intra_gbit=100.0)
    none = Network(10.0, latency_s=0.0, ranks_per_node=4, intra_gbit=100.0)
    assert two.allreduce_two_level(1e6, 16) - none.allreduce_two_level(1e6, 16) == pytest.approx((6 + 6) * lat)


def test_nodes_share_the_nic_and_the_sensitivity_table(study):
    lm = study["models"]["transformer_lm_wikitext103_267k"]["results"]
    step = {(r["topology"], r["world_size"]): r["step_s"][SPEEDUP_SUBJECT] for r in lm if r["variant"] == "as_built"}
    # 8 GPUs share a node's NIC: the exchange crossing nodes is slower than on a NIC per GPU
    assert step[("nodes_of_8", 64)] > step[("flat", 64)]
    rows = paper.latency_sensitivity(worlds=(16,))
    assert {r["latency_s"] for r in rows} == {0.0, paper.PAPER_LATENCY_S, 5 * paper.PAPER_LATENCY_S}
    study = dict(study, latency_sensitivity=rows)
    assert "## Latency sensitivity" in paper.markdown(study)


def test_node_aware_exchange_beside_e_on_nodes(study):
    for m in study["models"].values():
        for r in m["results"]:
            na = r["node_aware"]
            if r["topology"] == "flat" or r["world_size"] == paper.GPUS_PER_NODE:  # no nodes, or one node
                assert na is None and r["step_s"][paper.NODE_AWARE] == r["step_s"][SPEEDUP_SUBJECT]
                continue
            # several nodes of 8: fewer ids cross, the exchange and the step are shorter
            assert 0 < na["dedup_ratio"] < 1 and na["step_over_flat"] < 1
            assert na["exchange_fwd_s"]["node"] < na["exchange_fwd_s"]["flat"]
            assert na["grad_rows_s"]["node"] < na["grad_rows_s"]["flat"]
    assert "## Node-aware exchange (e-n) against the flat one (e), nodes_of_8" in paper.markdown(study)
