"""Cost model sanity: ring formulas by hand, monotone in bandwidth, schedule never slower."""
import json

import pytest

from embrace_fairseq.perf import simulator as sim
from embrace_fairseq.perf.simulator import Network, Options, Profile, predict
from embrace_fairseq.perf.simulator import __main__ as simulator_cli

STRATS = sim.STRATEGIES


def _profile(tied=None, vocab=20000, unique=None):
    layers = [(f"layer{i}", 400_000) for i in range(6)]
    return Profile(
        name="toy", vocab=vocab, dim=128, dense_layers=layers, tokens_per_rank=2048,
        forward_s=0.05, backward_s=0.10, optimizer_s=0.01,
        unique_ids_per_rank=unique or {}, tied_output=tied,
    )


def test_ring_formulas_by_hand():
    net = Network(8.0, latency_s=1e-3)  # 1e9 bytes/s
    assert net.bytes_per_s == 1e9
    # all-reduce of 1 GB on 4 ranks: 2*3 steps of latency + 2*3/4 of the payload
    assert net.allreduce(1e9, 4) == pytest.approx(6e-3 + 1.5)
    assert net.allgather(1e9, 4) == pytest.approx(3e-3 + 0.75)
    assert net.reduce_scatter(1e9, 4) == net.allgather(1e9, 4)
    assert net.alltoall(5e8, 4) == pytest.approx(3e-3 + 0.5)
    assert net.allreduce(1e9, 1) == net.allgather(1e9, 1) == net.alltoall(1e9, 1) == 0.0
    with pytest.raises(ValueError):
        Network(0.0)


def test_dense_strategies_by_hand():
    p = _profile()
    net = Network(8.0, latency_s=0.0)
    table_and_dense = (20000 * 128 + 6 * 400_000) * 4
    expect = 0.16 + 2 * 3 / 4 * table_and_dense / 1e9
    for s in ("fairseq_legacy_ddp", "deepspeed"):
        assert predict(p, s, 4, net).step_s == pytest.approx(expect)


@pytest.mark.parametrize("tied", [None, "gather", "vocab_parallel"])
def test_one_rank_is_compute_only(tied):
    p = _profile(tied)
    for s in STRATS:
        r = predict(p, s, 1, Network(1.0))
        assert r.step_s == pytest.approx(0.16) and r.comm_s == 0.0


@pytest.mark.parametrize("tied", [None, "gather"])
@pytest.mark.parametrize("world", [2, 4, 16, 64])
def test_monotone_in_bandwidth_and_schedule_helps(tied, world):
    p = _profile(tied)
    for latency in (10e-6, 1e-4):
        last = {s: float("inf") for s in STRATS}
        for gbit in (1, 10, 25, 100, 400):
            net = Network(gbit, latency_s=latency)
            preds = {s: predict(p, s, world, net) for s in STRATS}
            steps = {s: r.step_s for s, r in preds.items()}
            for s in STRATS:
                assert steps[s] <= last[s] + 1e-12, (s, gbit)
                assert steps[s] >= preds[s].compute_s - 1e-12
                # EmbRace's optimizer steps a shard of the table: less compute than the rest
                assert preds[s].compute_s <= 0.16 + 1e-12
            # without cutting buckets into pieces the schedule only reorders and overlaps:
            # never slower than no schedule
            whole = Options(embrace_piece_bytes=Options().embrace_bucket_bytes)
            assert predict(p, "embrace_schedule", world, net, whole).step_s <= steps["embrace_noschedule"] + 1e-12
            # with pieces, at most the latency of the extra collectives (fast links, tiny steps)
            pieces = 6 * -(-400_000 * 4 // (1 << 20))  # 1 MB pieces of the six layers
            extra = pieces * net.allreduce(1, world) + net.alltoall(0, world)  # + the deferred rows
            assert steps["embrace_schedule"] <= steps["embrace_noschedule"] + extra
            last = steps


def test_schedule_hides_communication_and_sparse_grows_with_n():
    p = _profile()
    net = Network(10.0, latency_s=10e-6)
    d = predict(p, "embrace_noschedule", 8, net)
    e = predict(p, "embrace_schedule", 8, net)
    assert e.step_s < d.step_s and e.hidden_share > 0.3 and d.hidden_share == 0.0
    sparse = [predict(p, "sparse_allgather", n, net).detail["sparse_s"] for n in (2, 8, 32)]
    assert sparse[0] < sparse[1] < sparse[2]


def test_zipf_loads():
    # unique ids grow with tokens; matching a measured count finds the tokens back
    loads = sim.sparse_loads(50000, 4, tokens_per_rank=3000)
    assert 0 < loads.unique_mean < 3000
    t = sim.zipf_tokens_for_unique(50000, loads.unique_mean)
    assert t == pytest.approx(3000, rel=1e-3)
    # contiguous shards: rank 0 owns the frequent ids and serves more than the average
    assert loads.busiest_rows > loads.off_owner_mean
    strided = sim.sparse_loads(50000, 4, tokens_per_rank=3000, layout="strided")
    assert strided.busiest_rows < loads.busiest_rows
    assert 0 < loads.next_step_share <= 1
    measured = sim.sparse_loads(50000, 4, unique_per_rank=[1000, 1100, 900, 1000])
    assert measured.unique_mean == pytest.approx(1000) and measured.unique_max == 1100


def _toy_json(unique):
    p = _profile()
    return {
        "vocab": p.vocab, "dim": p.dim, "dense_numel": p.dense_numel,
        "dense_layers": [{"name": n, "numel": k} for n, k in p.dense_layers], "tokens_per_rank": p.tokens_per_rank,
        "compute_s": {"forward": 0.05, "backward": 0.10, "optimizer": 0.01}, "unique_ids_per_rank": unique,
    }


# the toy model's table and dense layers in bytes (fp32): what the stock strategies all-reduce
TOY_ALLREDUCE_BYTES = (20000 * 128 + 6 * 400_000) * 4


def _dense_step_by_hand(gbit, n, *, latency_s=1e-4, efficiency=1.0, overhead_s=0.0, host_s_per_byte=0.0, cpus=0):
    """Step time of fairseq legacy_ddp or DeepSpeed on the toy model, alpha-beta by hand: one
    flat buffer (it fits both caps), all-reduced after the backward; N ranks on ``cpus`` cores
    slow compute and host work per byte by N / cpus."""
    share = max(1.0, n / cpus) if cpus else 1.0
    wire = 1.0 / (gbit * 1e9 / 8 * efficiency) + host_s_per_byte * share  # seconds per byte
    return 0.16 * share + overhead_s + 2 * (n - 1) * latency_s + 2 * (n - 1) / n * TOY_ALLREDUCE_BYTES * wire


def test_validate_against_hand_computed_costs(tmp_path):
    runs = [
        {"model": "toy", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": "deepspeed",
         "median_step_s": 0.5},
        {"model": "toy", "world_size": 2, "link_gbit": 10.0, "latency_ms": 0.1, "strategy": "legacy_ddp",
         "median_step_s": 0.2, "step_s": [0.19, 0.2, 0.2, 0.23]},
        {"model": "toy", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": "(c) sparse all-gather?",
         "median_step_s": 1.0},  # unknown strategy names are skipped, not guessed
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"profiles": {"toy": _toy_json({"4": [900, 950, 1000, 1010]})}, "runs": runs}))
    res = sim.validate(json.loads(path.read_text()))
    assert [r["strategy"] for r in res["runs"]] == ["deepspeed", "fairseq_legacy_ddp"]
    # 0.16 s compute + 6 latency steps + 1.5 x 19.84 MB at 125 MB/s = 0.39868 s
    assert _dense_step_by_hand(1.0, 4) == pytest.approx(0.39868)
    for r, run in zip(res["runs"], runs):
        hand = _dense_step_by_hand(run["link_gbit"], run["world_size"])
        assert r["predicted_s"] == pytest.approx(hand, rel=1e-12)
        assert r["rel_error"] == pytest.approx((hand - run["median_step_s"]) / run["median_step_s"], rel=1e-12)
    assert res["runs"][1]["measured_rel_iqr"] == pytest.approx((0.2075 - 0.1975) / 0.2)
    assert res["median_measured_rel_iqr"] is None  # one run has no step times
    assert simulator_cli.main(["validate", str(path), "--out", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["runs"][0]["predicted_s"] == pytest.approx(0.39868)
    with pytest.raises(ValueError, match="lacks the field"):
        sim.validate({"profiles": {"toy": {"vocab": 3}}, "runs": []})


def test_validate_skips_loopback_runs():
    bench = {"profiles": {"toy": _toy_json({})}, "meta": {"fallback_loopback": True, "fallback_reason": "no root"},
             "runs": [{"model": "toy", "world_size": 2, "link_gbit": 1.0, "strategy": "deepspeed",
                       "median_step_s": 1.0}]}
    res = sim.validate(bench)
    assert res["runs"] == [] and "no root" in res["skipped"]


def test_strategy_names():
    assert sim.canonical_strategy("e") == "embrace_schedule"
    assert sim.canonical_strategy("legacy_ddp") == "fairseq_legacy_ddp"
    with pytest.raises(ValueError, match="unknown strategy"):
        sim.canonical_strategy("horovod")


def test_deferring_rows_only_helps():
    p = _profile(unique={8: [3000] * 8})
    for gbit in (1, 10, 100):
        net = Network(gbit, latency_s=1e-4)
        with_defer = predict(p, "embrace_schedule", 8, net, Options(defer_rows=True))
        without = predict(p, "embrace_schedule", 8, net, Options(defer_rows=False))
        assert with_defer.step_s <= without.step_s + 1e-12
        assert 0 < with_defer.detail["deferred_share"] < 1 and without.detail["deferred_share"] == 0


def test_fit_recovers_a_known_network():
    # runs whose step times follow a known network, computed by hand: efficiency 0.75,
    # 1 ms per collective, 4 ns of host work per byte; 2 and 4 ranks on 2 cores
    truth = dict(efficiency=0.75, overhead_s=1e-3, host_s_per_byte=4e-9, cpus=2)
    runs = [{"model": "toy", "world_size": n, "link_gbit": gbit, "latency_ms": 0.1, "strategy": s,
             "median_step_s": _dense_step_by_hand(gbit, n, **truth)}
            for gbit in (1.0, 10.0) for n in (2, 4) for s in ("fairseq_legacy_ddp", "deepspeed")]
    bench = {"profiles": {"toy": _toy_json({"4": [1000] * 4})}, "runs": runs, "meta": {"machine": {"cpus": 2}}}
    grid = {"efficiency": (0.5, 0.75, 1.0), "overhead_s": (0.0, 1e-3), "host_s_per_byte": (0.0, 4e-9)}
    fit = sim.fit_network(bench, grid=grid)
    assert (fit["efficiency"], fit["overhead_s"], fit["host_s_per_byte"]) == (0.75, 1e-3, 4e-9)
    assert fit["in_sample_mean_abs_rel_error"] < 1e-9 and fit["holdout"]["link_gbit"] < 1e-9
    # without the oversubscription of compute the 4-rank runs are predicted too fast
    plain = sim.validate(bench, efficiency=0.75, overhead_s=1e-3, host_s_per_byte=4e-9, oversubscription=False)
    assert all(r["rel_error"] < -0.2 for r in plain["runs"] if r["world_size"] == 4)
    assert all(abs(r["rel_error"]) < 1e-9 for r in plain["runs"] if r["world_size"] == 2)


def _fixed_loads(p, busiest_rows, next_step_share, unique_max=0.0):
    """Stand in for the Zipf model: the sparse loads of every world size given by hand."""
    loads = sim.SparseLoads(unique_mean=unique_max, unique_max=unique_max, off_owner_mean=0.0,
                            busiest_rows=busiest_rows, next_step_share=next_step_share, tokens_eff=0.0)
    p.loads = lambda world_size, layout="contiguous": loads
    return p


def test_embrace_costs_by_hand():
    # 2 ranks at 1e9 bytes/s, 1 ms per message step; two 1 MB layers in buckets of their own;
    # the busiest rank moves 100 rows of 10 fp32 and their 4-byte ids
    p = _fixed_loads(Profile(name="hand", vocab=1000, dim=10, dense_layers=[("in", 250_000), ("out", 250_000)],
                             tokens_per_rank=100, forward_s=0.1, backward_s=0.2, optimizer_s=0.05), 100, 0.5)
    net = Network(8.0, latency_s=1e-3)
    opts = Options(embrace_bucket_bytes=1_000_000, embrace_piece_bytes=1 << 20, defer_rows=False)
    F, B = 0.1, 0.2
    O = 0.05 * (500_000 + 500 * 10) / (500_000 + 1000 * 10)  # the optimizer steps half the table
    header = 1e-3 + 24 / 1e9  # one peer, three int64
    ids, rows = 1e-3 + 400 / 1e9, 1e-3 + 4000 / 1e9  # AlltoAll: one message step + the busiest bytes
    layer = 2e-3 + 1e6 / 1e9  # ring all-reduce of 1 MB on 2 ranks
    d = predict(p, "embrace_noschedule", 2, net, opts)
    assert d.step_s == pytest.approx(F + B + O + header + ids + 2 * rows + 2 * layer, rel=1e-12)
    assert d.exposed_comm_s == pytest.approx(d.comm_s) and d.compute_s == pytest.approx(F + B + O)
    # the schedule hides the output layer's all-reduce (ready half-way through the backward);
    # the gradient rows go before the input layer's all-reduce, both after the backward
    e = predict(p, "embrace_schedule", 2, net, opts)
    assert e.step_s == pytest.approx(header + ids + rows + F + B + rows + layer + O, rel=1e-12)
    assert e.hidden_share == pytest.approx(layer / (header + ids + 2 * rows + 2 * layer), rel=1e-9)
    # deferring half of the rows into the next forward moves 2000 bytes off the critical path
    deferred = predict(p, "embrace_schedule", 2, net, Options(**{**opts.__dict__, "defer_rows": True}))
    assert deferred.step_s == pytest.approx(e.step_s - 2000 / 1e9, rel=1e-12)


def test_sparse_allgather_by_hand():
    p = _fixed_loads(_profile(), 0.0, 1.0, unique_max=1000.0)
    net = Network(8.0, latency_s=0.0)  # 1e9 bytes/s, no latency
    n = 4
    gather = lambda total: (n - 1) / n * total / 1e9  # noqa: E731  (ring all-gather)
    sparse = 2 * gather(8 * n) + gather(n * 1000 * 8) + gather(n * 1000 * 128 * 4)  # sizes, int64 ids, rows
    dense = 2 * (n - 1) / n * 6 * 400_000 * 4 / 1e9
    r = predict(p, "sparse_allgather", n, net)
    assert r.detail["sparse_s"] == pytest.approx(sparse, rel=1e-12)
    assert r.step_s == pytest.approx(0.16 + sparse + dense, rel=1e-12)


def test_tied_output_inferred_from_recorded_table_gather():
    prof = {"vocab": 1000, "dim": 8, "dense_numel": 10, "dense_layers": [{"name": "l", "numel": 10}],
            "tokens_per_rank": 100, "compute_s": {"forward": 0.1, "backward": 0.2, "optimizer": 0.0}}
    run = {"model": "m", "world_size": 2, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": "embrace_schedule",
           "median_step_s": 1.0, "bytes_per_rank_per_step": {"rows": 10.0}}
    profiles, _ = sim.runs_and_profiles({"profiles": {"m": prof}, "runs": [run]})
    assert profiles["m"].tied_output is None
    run["bytes_per_rank_per_step"]["table_gather"] = 4000.0
    profiles, _ = sim.runs_and_profiles({"profiles": {"m": prof}, "runs": [run]})
    assert profiles["m"].tied_output == "gather"
