"""The simulator's network with nodes: a shared node NIC, a faster link inside the node,
the two-level all-reduce and the node-aware exchange, against figures computed by hand."""
import pytest

from embrace_fairseq.perf.simulator import Network, Options, Profile, predict

GB = 1e9 / 8  # bytes per second of 1 Gbit/s


def test_one_rank_per_node_is_the_flat_model():
    flat, nodes1 = Network(1.0, latency_s=0.0), Network(1.0, latency_s=0.0, ranks_per_node=1, intra_gbit=100.0)
    for n in (2, 4, 8):
        assert nodes1.allreduce(1e6, n) == flat.allreduce(1e6, n)
        assert nodes1.alltoall(1e6, n) == flat.alltoall(1e6, n)
        assert nodes1.allreduce_two_level(1e6, n) == flat.allreduce(1e6, n)


def test_shared_node_nic_and_fast_inside():
    net = Network(1.0, latency_s=0.0, ranks_per_node=2, intra_gbit=100.0)
    # AlltoAll on 2 x 2: each rank sends 2/3 of its bytes off the node, two ranks per NIC
    assert net.alltoall(3e6, 4) == pytest.approx(2 * 3e6 * 2 / 3 / GB)
    # a ring in node order: its per-rank volume over the slow edge, as without nodes
    assert net.allreduce(8e6, 4) == pytest.approx(1.5 * 8e6 / GB)
    # two levels: (k-1)/k S twice inside, then the node's 2 rails share the NIC: 2 (m-1)/m S across
    inside = 2 * 0.5 * 8e6 / (100 * GB)
    assert net.allreduce_two_level(8e6, 4) == pytest.approx(inside + 8e6 / GB)
    assert net.allreduce_two_level(8e6, 4) < net.allreduce(8e6, 4)
    # one node: everything inside
    assert net.alltoall(3e6, 2) == pytest.approx(3e6 / (100 * GB))
    assert net.allreduce(8e6, 2) == pytest.approx(8e6 / (100 * GB))


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        Network(1.0, ranks_per_node=0)
    with pytest.raises(ValueError):
        Network(1.0, intra_gbit=0.0)


# ------------------------------------------------------------------ the node-aware exchange


def _zipf_profile(vocab=50_000, tokens=2048, zipf_s=1.0, unique=None):
    layers = [(f"layer{i}", 400_000) for i in range(6)]
    return Profile(name="zipf", vocab=vocab, dim=128, dense_layers=layers, tokens_per_rank=tokens,
                   forward_s=0.05, backward_s=0.10, optimizer_s=0.01, zipf_s=zipf_s,
                   unique_ids_per_rank=unique or {})


def _same_prediction(a, b):
    assert (a.step_s, a.comm_s, a.exposed_comm_s, a.compute_s, a.detail) == \
        (b.step_s, b.comm_s, b.exposed_comm_s, b.compute_s, b.detail)


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
@pytest.mark.parametrize("defer", [False, True])
def test_node_aware_exchange_without_nodes_is_the_flat_one(layout, defer):
    p, opts = _zipf_profile(), Options(shard_layout=layout, defer_rows=defer)
    for n in (2, 4, 8):
        # one rank per node, or all ranks on one node: the library runs the flat exchange
        for net in (Network(10.0), Network(10.0, ranks_per_node=1, intra_gbit=100.0),
                    Network(10.0, ranks_per_node=n, intra_gbit=100.0)):
            _same_prediction(predict(p, "embrace_node", n, net, opts), predict(p, "embrace_schedule", n, net, opts))
        # and the two hops' loads reduce to the flat exchange's: no node hop, the rail is the job
        flat, nodes = p.loads(n, layout), p.node_loads(n, 1, layout)
        assert nodes.node_hop_rows == 0.0 and nodes.dedup_ratio == pytest.approx(1.0)
        assert nodes.rail_rows == pytest.approx(flat.busiest_rows, rel=1e-12)
        assert nodes.rail_nic_rows == pytest.approx(flat.busiest_rows, rel=1e-12)
        assert nodes.flat_nic_rows == pytest.approx(flat.busiest_rows, rel=1e-12)


def test_node_aware_exchange_by_hand():
    # 8 ids, every one drawn by every rank (uniform, a million tokens); 2 nodes of 2 ranks,
    # strided: rank r owns ids r and r + 4, node 0 owns {0, 1, 4, 5}
    p = Profile(name="hand", vocab=8, dim=10, dense_layers=[("l", 1000)], tokens_per_rank=1e6, forward_s=0.1,
                backward_s=0.2, optimizer_s=0.0, zipf_s=0.0)
    nl = p.node_loads(4, 2, "strided")
    # node hop: a rank sends its 4 ids of the other local index to its proxy, which gets 4
    # rail hop: a proxy asks the owner on the other node once for its 2 ids, for the node
    assert (nl.node_unique_mean, nl.node_hop_rows, nl.rail_rows, nl.rail_nic_rows) == pytest.approx((8, 4, 2, 4))
    # flat: each rank of node 0 asks node 1's owners for 4 ids, 8 through the NIC; merged: 4
    assert (nl.flat_nic_rows, nl.dedup_ratio) == pytest.approx((8, 0.5))
    assert p.loads(4, "strided").busiest_rows == pytest.approx(6)  # owner: 2 ids for 3 peers; asker: 6 ids

    lat, B, I = 1e-3, 1e9, 1e10  # 8 Gbit/s NIC per node, 80 inside
    net = Network(8.0, latency_s=lat, ranks_per_node=2, intra_gbit=80.0)
    opts = Options(defer_rows=False, shard_layout="strided")
    node, flat = predict(p, "embrace_node", 4, net, opts), predict(p, "embrace_schedule", 4, net, opts)
    row = 10 * 4
    # node hop: header (1 peer, 4 int64) and 4 ids, inside; rail hop: header (1 peer) and 2
    # ids per rank, 2 rails through the NIC; rows back: the rail, then fanned out inside
    ids = (lat + 32 / I) + (lat + 4 * 4 / I) + (lat + 2 * 32 / B) + (lat + 2 * 2 * 4 / B)
    rows = (lat + 2 * 2 * row / B) + (lat + 4 * row / I)
    assert node.detail["exchange_fwd_s"] == pytest.approx(ids + rows, rel=1e-12)
    assert node.detail["grad_rows_s"] == pytest.approx(rows, rel=1e-12)
    assert node.detail["node_dedup_ratio"] == pytest.approx(0.5)
    # flat: 3 message steps each; 2/3 of a rank's header leaves the node, two ranks' worth
    # per NIC; ids and rows: the node's 8 rows leave through its NIC
    flat_ids = (3 * lat + 2 * 3 * 24 * 2 / 3 / B) + (3 * lat + 8 * 4 / B)
    assert flat.detail["exchange_fwd_s"] == pytest.approx(flat_ids + 3 * lat + 8 * row / B, rel=1e-12)
    assert flat.detail["grad_rows_s"] == pytest.approx(3 * lat + 8 * row / B, rel=1e-12)


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_node_aware_exchange_crosses_nodes_less(layout):
    p, opts = _zipf_profile(), Options(shard_layout=layout, defer_rows=False)
    ratios = {}
    for k in (2, 4, 8):
        for nodes in (2, 4):
            n = k * nodes
            nl = p.node_loads(n, k, layout)
            ratios[(nodes, k)] = nl.dedup_ratio
            # the node's union is less than its ranks' sum, and the NIC carries less
            assert nl.node_unique_mean < k * p.loads(n, layout).unique_mean
            assert nl.rail_nic_rows < nl.flat_nic_rows
            net = Network(10.0, latency_s=0.0, ranks_per_node=k, intra_gbit=1000.0)
            node, flat = predict(p, "embrace_node", n, net, opts), predict(p, "embrace_schedule", n, net, opts)
            assert node.detail["exchange_fwd_s"] < flat.detail["exchange_fwd_s"]
            assert node.detail["grad_rows_s"] < flat.detail["grad_rows_s"]
            assert node.step_s < flat.step_s
    # as measured on real batches (results/bench/node_dedup.json): more ranks per node share
    # more; the number of nodes hardly matters
    for nodes in (2, 4):
        assert 1 > ratios[(nodes, 2)] > ratios[(nodes, 4)] > ratios[(nodes, 8)]
    assert ratios[(2, 4)] == pytest.approx(ratios[(4, 4)], abs=0.02)


def test_dedup_ratio_against_measured_batches():
    # node_dedup.json, translation (8,104 ids, ~420 unique ids per rank): node-aware over
    # flat ids crossing between nodes, per nodes x ranks per node
    measured = {(2, 2): 0.860, (2, 4): 0.721, (4, 4): 0.721, (2, 8): 0.572}
    p = _zipf_profile(vocab=8104, tokens=426, unique={4: [420.0] * 4})
    for (nodes, k), ratio in measured.items():
        assert p.node_loads(nodes * k, k, "strided").dedup_ratio == pytest.approx(ratio, abs=0.03)


def test_flat_exchange_on_nodes_charges_the_node_nic():
    p = _zipf_profile()
    n, k = 16, 4
    even = k * p.loads(n, "strided").busiest_rows * (n - k) / (n - 1)  # K ranks' worth of the busiest
    # strided: every rank about as busy, the node's sum is K times the busiest rank's
    assert p.node_loads(n, k, "strided").flat_nic_rows == pytest.approx(even, rel=5e-3)
    # contiguous: one rank serves the head, its node's others are not as busy
    skewed = k * p.loads(n, "contiguous").busiest_rows * (n - k) / (n - 1)
    assert p.node_loads(n, k, "contiguous").flat_nic_rows < skewed / 2
    net = Network(10.0, latency_s=0.0, ranks_per_node=k, intra_gbit=1e6)
    e = predict(p, "embrace_schedule", n, net, Options(shard_layout="contiguous", defer_rows=False))
    B = 10e9 / 8
    rows = p.node_loads(n, k, "contiguous").flat_nic_rows * 128 * 4
    assert e.detail["grad_rows_s"] == pytest.approx(rows / B, rel=1e-6)


def test_hops_of_the_node_aware_exchange():
    net = Network(1.0, latency_s=1e-3, ranks_per_node=4, intra_gbit=100.0)
    # inside: 3 peers, the fast link; along the rails: 1 peer per other node, 4 rails per NIC
    assert net.alltoall_inside(1e6, 16) == pytest.approx(3e-3 + 1e6 / (100 * GB))
    assert net.alltoall_rails(1e6, 16) == pytest.approx(3e-3 + 4e6 / GB)
    assert net.alltoall_rails(1e6, 16, nic_bytes=2e6) == pytest.approx(3e-3 + 2e6 / GB)
    # no nodes: nothing inside, the one rail is the job; one node: nothing across
    flat = Network(1.0, latency_s=1e-3)
    assert flat.alltoall_inside(1e6, 16) == 0.0 and flat.alltoall_rails(1e6, 16) == flat.alltoall(1e6, 16)
    assert net.alltoall_rails(1e6, 4) == 0.0
