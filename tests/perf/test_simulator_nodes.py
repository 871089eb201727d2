"""The simulator's network with nodes: a shared node NIC, a faster link inside the node,
and the two-level all-reduce, against figures computed by hand."""
import pytest

from embrace_fairseq.perf.simulator import Network

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
