"""The node-aware exchange (ids deduplicated per node, rows fanned out inside it) against
the flat exchange, in real gloo ranks on emulated 2 x 2 and 2 x 3 layouts: the same rows
bit for bit, the same gradients and SGD steps up to summation order, less inter-node
traffic; on one node (or one rank per node) it is the flat exchange."""
import pytest

import rank_fns_node_exchange as fns
from embrace_fairseq.core.node_topology import NodeTopology, topology_for
from embrace_fairseq.tools.local_ranks import run_ranks

CASES = ["random", "padding", "repeats", "empty_rank", "hot"]
TOL = 1e-6
ROW_KINDS = ("rows", "grad_rows")


def _inter(results, route, kinds):
    return sum(r[case]["ledgers"][route]["inter_node"].get(k, 0) for r in results for case in ["hot"] for k in kinds)


@pytest.mark.parametrize("world,ranks_per_node,layout", [
    (4, 2, "strided"),  # 2 x 3 (6 ranks) in the slow run: ~30 s on 2 cores
    pytest.param(6, 3, "strided", marks=pytest.mark.slow), pytest.param(6, 3, "contiguous", marks=pytest.mark.slow)])
def test_node_route_equals_flat(world, ranks_per_node, layout):
    vocab, dim = 23, 4  # 23 rows: divisible by no world size here
    results = run_ranks(fns.flat_vs_node, world, ranks_per_node, vocab, dim, CASES, layout)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            where = f"world={world} rank={rank} case={case}"
            assert r["node_aware"] == (False, True), where
            assert r["rows_equal"] and r["rows_diff"] < TOL, (where, r["rows_diff"])
            assert r["grad_diff"] < TOL and r["weight_diff"] < TOL, (where, r["grad_diff"], r["weight_diff"])
            for route in ("flat", "node"):  # both ledgers counted the exchange's rows
                assert r["ledgers"][route]["sent"].get("rows", 0) >= r["ledgers"][route]["inter_node"].get("rows", 0)
    # every rank asks the same ids: each off-node row crosses once per node instead of once per rank
    flat, node = _inter(results, "flat", ROW_KINDS), _inter(results, "node", ROW_KINDS)
    assert flat > 0 and node * ranks_per_node == flat, (flat, node)
    # on random batches the node route never sends more rows across nodes
    for case in ("random", "repeats"):
        f = sum(r[case]["ledgers"]["flat"]["inter_node"].get(k, 0) for r in results for k in ROW_KINDS)
        n = sum(r[case]["ledgers"]["node"]["inter_node"].get(k, 0) for r in results for k in ROW_KINDS)
        assert n <= f, (case, n, f)


@pytest.mark.parametrize("world,ranks_per_node", [(3, 3), (3, 1)])
def test_one_node_or_one_rank_per_node_is_the_flat_exchange(world, ranks_per_node):
    results = run_ranks(fns.flat_vs_node, world, ranks_per_node, 10, 3, ["random"])
    for r in results:
        c = r["random"]
        assert c["node_aware"] == (False, False)
        assert c["rows_equal"] and c["rows_diff"] == 0.0 and c["grad_diff"] == 0.0 and c["weight_diff"] == 0.0
        assert c["ledgers"]["flat"] == c["ledgers"]["node"]


def test_bad_input_stops_every_rank_of_every_node():
    """Ranks that disagree on the nodes all stop at construction; an invalid id on one
    rank stops every rank of both nodes, naming the id and the rank."""
    results = run_ranks(fns.bad_inputs, 4, 2, 3, timeout_s=120)
    assert all(d is not None and "ranks per node" in d for d, _, _ in results), results
    assert all(m is not None and "99" in m and "rank 3" in m for _, m, _ in results), results
    # nodes the world does not fill: the flat exchange works without them, the node-aware one stops
    assert all(u[0] is None and u[1] == (2, 2) and "do not fill nodes" in u[2] for _, _, u in results), results


def test_launcher_numbering_is_checked(monkeypatch):
    from embrace_fairseq.core.node_topology import _launcher_disagrees

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not _launcher_disagrees(NodeTopology(4, 2), 3)  # rank 3 = node 1, local 1
    assert _launcher_disagrees(NodeTopology(4, 2), 2)  # a launcher that numbered nodes otherwise
    assert not _launcher_disagrees(NodeTopology(4, 1), 2)  # nodes given by hand: taken as given


def test_topology_from_the_launcher(monkeypatch):
    monkeypatch.delenv("EMBRACE_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert topology_for(8) == NodeTopology(8, 2) and topology_for(8).is_hierarchical
    monkeypatch.setenv("EMBRACE_RANKS_PER_NODE", "4")
    assert topology_for(8).ranks_per_node == 4
    assert topology_for(8, ranks_per_node=8).num_nodes == 1
    monkeypatch.delenv("EMBRACE_RANKS_PER_NODE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher's name for it
    assert topology_for(8) == NodeTopology(8, 4)
    monkeypatch.delenv("LOCAL_SIZE")
    assert topology_for(8) == NodeTopology(8, 8)
    with pytest.raises(ValueError, match="do not fill nodes"):
        NodeTopology(6, 4)


def test_deepspeed_hook_with_the_node_exchange_trains_as_stock():
    """The DeepSpeed "embrace" section's "exchange": "node" and "two_level_allreduce" on 2
    emulated nodes of 2 ranks: the tied model trains as stock DeepSpeed does (losses and
    weights within 1e-5)."""
    import rank_fns_deepspeed as D

    results = run_ranks(fns.deepspeed_node_run, 4, 4, 2, timeout_s=300, pg_timeout_s=120)
    for rank, r in enumerate(results):
        assert r["node_aware"], rank
        assert D.rel_diff(r["ours"]["losses"], r["ref"]["losses"]) < 1e-5, (rank, r["ours"]["losses"], r["ref"]["losses"])
        for name, value in r["ref"]["state"].items():
            assert D.rel_diff(r["ours"]["state"][name], value) < 1e-5, (rank, name)


def test_dense_all_reduce_in_two_levels():
    """gloo's all-reduce knows no nodes: on 2 emulated nodes of 2 ranks the scheduled
    reducer's pieces go in two levels (inside the node, across on the rails, inside
    again): the same averaged gradients, less across nodes than one ring over all ranks
    would send from each node."""
    results = run_ranks(fns.dense_two_level, 4, 2)
    for r in results:
        assert r["modes"] == (False, True)
        assert r["diff"] < 1e-6, r
    # flat: a ring over 4 ranks on one node sends nothing across; over 2 nodes each
    # node's last rank would send its whole ring share across
    assert all(r["inter"]["flat"] == 0 for r in results)
    ring_share = results[0]["sent"]["flat"]  # 2 (N-1)/N of the payload, every rank
    across = sum(r["inter"]["two_level"] for r in results) / 2  # per node
    assert 0 < across < ring_share, (across, ring_share)
