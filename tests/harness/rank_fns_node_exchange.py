"""Per-rank bodies of the node-aware exchange tests (spawned in real gloo ranks; the
nodes are emulated by ``ranks_per_node``: the routes and groups are the real ones)."""
import torch

from embrace_fairseq import CommLedger, InvalidIdError, ShardedEmbedding

from rank_fns_embedding import _batch


def _ids(case, rank, world, vocab):
    if case == "hot":
        # every rank asks the same ids: the node-aware route sends each off-node row once per node
        return torch.arange(vocab).repeat(2)
    return _batch(case, rank, world, vocab)


def flat_vs_node(rank, world, ranks_per_node, vocab, dim, cases, layout="strided"):
    """Rows, shard gradients and SGD-updated shards of the two routes; the ledgers' bytes."""
    out = {}
    for case in cases:
        padding_idx = 1 if case == "padding" else None
        per_route = {}
        for route in ("flat", "node"):
            torch.manual_seed(11)
            ledger = CommLedger()
            emb = ShardedEmbedding(vocab, dim, padding_idx=padding_idx, ledger=ledger, layout=layout,
                                   exchange=route, ranks_per_node=ranks_per_node)
            opt = torch.optim.SGD(emb.parameters(), lr=0.3)
            rows = []
            for step in range(2):
                ids = _ids(case, rank + 10 * step, world, vocab)
                coef = torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(100 * step + rank))
                y = emb(ids)
                rows.append(y.detach().clone())
                opt.zero_grad()
                (y * coef).sum().backward()
                grad = emb.weight.grad.clone()
                opt.step()
            per_route[route] = {
                "node_aware": emb.node_aware,
                "rows": rows,
                "grad": grad,
                "weight": emb.weight.detach().clone(),
                "ledger": ledger.snapshot(),
            }
        f, n = per_route["flat"], per_route["node"]
        out[case] = {
            "node_aware": (f["node_aware"], n["node_aware"]),
            # the first step's rows bit for bit; the second reads weights stepped with
            # gradients summed in another order
            "rows_equal": torch.equal(f["rows"][0], n["rows"][0]),
            "rows_diff": (f["rows"][1] - n["rows"][1]).abs().max().item() if f["rows"][1].numel() else 0.0,
            "grad_diff": (f["grad"] - n["grad"]).abs().max().item() if f["grad"].numel() else 0.0,
            "weight_diff": (f["weight"] - n["weight"]).abs().max().item() if f["weight"].numel() else 0.0,
            "ledgers": {"flat": f["ledger"], "node": n["ledger"]},
        }
    return out


def bad_inputs(rank, world, ranks_per_node, bad_rank):
    """The bad inputs in one job: ranks that disagree on the nodes, then an invalid id,
    then nodes the world does not fill."""
    return (disagreeing_topology(rank, world), invalid_id(rank, world, ranks_per_node, bad_rank),
            unfilled_nodes(rank, world))


def unfilled_nodes(rank, world):
    """A launcher that says 3 ranks per node in a job of 4: the flat exchange needs no
    nodes and works; the node-aware one stops at construction, on every rank."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "3"
    try:
        flat = ShardedEmbedding(8, 2)
        rows = flat(torch.tensor([1, 5])).shape
        try:
            ShardedEmbedding(8, 2, exchange="node")
        except ValueError as e:
            return (flat.topology, tuple(rows), str(e))
        return (flat.topology, tuple(rows), None)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def invalid_id(rank, world, ranks_per_node, bad_rank):
    emb = ShardedEmbedding(9, 2, exchange="node", ranks_per_node=ranks_per_node)
    ids = torch.tensor([1, 2, 3])
    if rank == bad_rank:
        ids = torch.tensor([1, 99, 3])
    try:
        emb(ids)
    except InvalidIdError as e:
        return str(e)
    return None


def disagreeing_topology(rank, world):
    # rank 0 thinks nodes hold 2 ranks, the others 4: every rank must stop, none may hang
    try:
        ShardedEmbedding(8, 2, exchange="auto", ranks_per_node=2 if rank == 0 else 4)
    except RuntimeError as e:
        return str(e)
    return None


def deepspeed_node_run(rank, world, steps, ranks_per_node):
    """Stock DeepSpeed (replicated tied table) against the EmbRace hook whose "embrace"
    section asks for the node-aware exchange: losses, weights, and the route taken."""
    import rank_fns_deepspeed as D

    D._ds_env(rank, world)
    torch.set_num_threads(1)
    ref = D.train(rank, world, sharded=False, tied=True, steps=steps)
    embrace = {"exchange": "node", "ranks_per_node": ranks_per_node, "two_level_allreduce": True}
    ours = D.train(rank, world, sharded=True, tied=True, steps=steps, embrace=embrace)
    return {"ref": ref, "ours": ours, "node_aware": ours["node_aware"]}


def dense_two_level(rank, world, ranks_per_node):
    """The scheduled reducer's dense all-reduce in two levels (gloo, emulated nodes)
    against the flat one: the averaged gradients, and the bytes that left the node."""
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.node_topology import NodeTopology
    from embrace_fairseq.schedule.executor import ScheduledAllReduce
    from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule

    out = {}
    for mode in ("flat", "two_level"):
        torch.manual_seed(0)
        # 7x5+5, 5x13+13, 13x3+3 elements: pieces and chunks of uneven sizes
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 13),
                                    torch.nn.Tanh(), torch.nn.Linear(13, 3))
        params = list(model.parameters())
        specs = [TensorSpec(f"p{i}", p.numel(), p.element_size(), i // 2) for i, p in enumerate(params)]
        schedule = build_schedule(specs, ScheduleOptions(piece_bytes=64, bucket_bytes=256, compute_bytes_per_s=1e9,
                                                         link_bytes_per_s=1e9))
        ledger = CommLedger()
        topology = NodeTopology(world, ranks_per_node if mode == "two_level" else world)
        reducer = ScheduledAllReduce(params, schedule, collectives.new_group(), ledger=ledger, topology=topology,
                                     single_thread=False, two_level=True)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        reducer.finish()
        out[mode] = {"grads": [p.grad.clone() for p in params], "two_level": reducer.two_level is not None,
                     "ledger": ledger.snapshot()}
        reducer.remove()
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(out["flat"]["grads"], out["two_level"]["grads"])),
        "modes": (out["flat"]["two_level"], out["two_level"]["two_level"]),
        "sent": {m: out[m]["ledger"]["sent"].get("dense_grad", 0) for m in out},
        "inter": {m: out[m]["ledger"]["inter_node"].get("dense_grad", 0) for m in out},
    }
