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


def test_validate_reads_bench_json(tmp_path):
    p = _profile()
    prof = {
        "vocab": p.vocab, "dim": p.dim, "dense_numel": p.dense_numel,
        "dense_layers": [{"name": n, "numel": k} for n, k in p.dense_layers],
        "tokens_per_rank": p.tokens_per_rank,
        "compute_s": {"forward": 0.05, "backward": 0.10, "optimizer": 0.01},
        "unique_ids_per_rank": {"4": [900, 950, 1000, 1010]},
    }
    truth = predict(_profile(unique={4: [900, 950, 1000, 1010]}), "embrace_schedule", 4, Network(1.0, latency_s=1e-4),
                    Options(defer_rows=False))  # validation models the exchange as implemented
    runs = [
        {"model": "toy", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": "embrace_schedule",
         "median_step_s": truth.step_s * 1.1},
        {"model": "toy", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": "(c) sparse all-gather?",
         "median_step_s": 1.0},  # unknown strategy names are skipped, not guessed
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"profiles": {"toy": prof}, "runs": runs}))
    res = sim.validate(json.loads(path.read_text()))
    assert len(res["runs"]) == 1
    assert res["runs"][0]["rel_error"] == pytest.approx(1 / 1.1 - 1)
    assert simulator_cli.main(["validate", str(path), "--out", str(tmp_path / "v.json")]) == 0
    with pytest.raises(ValueError, match="lacks the field"):
        sim.validate({"profiles": {"toy": {"vocab": 3}}, "runs": []})


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
    p = _profile(unique={4: [1000] * 4})
    prof = {
        "vocab": p.vocab, "dim": p.dim, "dense_numel": p.dense_numel,
        "dense_layers": [{"name": n, "numel": k} for n, k in p.dense_layers], "tokens_per_rank": p.tokens_per_rank,
        "compute_s": {"forward": 0.05, "backward": 0.10, "optimizer": 0.01}, "unique_ids_per_rank": {"4": [1000] * 4},
    }
    runs = []
    for gbit in (1.0, 10.0):
        # 4 ranks on 2 cores: compute and host work per byte twice as slow
        truth = Network(gbit, latency_s=1e-4, efficiency=0.75, overhead_s=1e-3, host_s_per_byte=4e-9, contention=2.0)
        for s in STRATS:
            step = predict(_profile(unique={4: [1000] * 4}), s, 4, truth, Options(defer_rows=False), compute_scale=2.0).step_s
            runs.append({"model": "toy", "world_size": 4, "link_gbit": gbit, "latency_ms": 0.1, "strategy": s,
                         "median_step_s": step})
    bench = {"profiles": {"toy": prof}, "runs": runs, "meta": {"machine": {"cpus": 2}}}
    grid = {"efficiency": (0.5, 0.75, 1.0), "overhead_s": (0.0, 1e-3), "host_s_per_byte": (0.0, 4e-9)}
    fit = sim.fit_network(bench, grid=grid)
    assert (fit["efficiency"], fit["overhead_s"], fit["host_s_per_byte"]) == (0.75, 1e-3, 4e-9)
    assert fit["in_sample_mean_abs_rel_error"] < 1e-9 and fit["holdout"]["link_gbit"] < 1e-9
    # without the oversubscription of compute the same runs are predicted too fast
    plain = sim.validate(bench, efficiency=0.75, overhead_s=1e-3, host_s_per_byte=4e-9, oversubscription=False)
    assert all(r["rel_error"] < -0.2 for r in plain["runs"])


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
