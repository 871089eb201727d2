"""How much of the embedding exchange the node-aware route keeps off the links between nodes.

``python -m embrace_fairseq.perf.node_dedup [--models lm,translation] [--shapes 2x2,2x4,4x4,2x8] [--steps 20]``

For a job of ``nodes x ranks_per_node`` ranks on the benchmark's real batches (the same
:class:`~embrace_fairseq.perf.bench.workloads.Batches` the benchmark steps through), it
counts the unique ids whose rows cross between nodes in one step, in each direction the
same number (rows in forward, gradient rows in backward):

* flat exchange: every rank's own unique ids whose owner is on another node;
* node-aware exchange: per node, the union of its ranks' unique ids whose owner is on
  another node (the proxies merge the node's requests;
  :mod:`~embrace_fairseq.core.node_exchange`).

The ratio node-aware / flat is what the route saves in the exchange's inter-node bytes
(ids and rows alike; headers aside). It depends on how much the ranks of a node share:
more ranks per node and hotter words share more. Same ownership as the tables' default
layout; no collective runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from embrace_fairseq.core.node_topology import NodeTopology
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, ShardPlan

REPO_ROOT = Path(__file__).resolve().parents[2]


def inter_node_ids(ids_per_rank: Sequence[torch.Tensor], plan: ShardPlan, topology: NodeTopology) -> Tuple[int, int]:
    """(flat, node-aware) unique ids that cross between nodes in one step.

    >>> plan, t = ShardPlan(8, 4, "strided"), NodeTopology(4, 2)
    >>> # ranks 0, 1 (node 0) both want id 2 (owner 2, node 1): asked twice flat, once per node
    >>> inter_node_ids([torch.tensor([2, 0]), torch.tensor([2]), torch.tensor([5]), torch.tensor([6])], plan, t)
    (3, 2)
    """
    flat, per_node = 0, [set() for _ in range(topology.num_nodes)]
    for rank, ids in enumerate(ids_per_rank):
        unique = torch.unique(ids.reshape(-1).long())
        owner_node = torch.div(plan.owner(unique), topology.ranks_per_node, rounding_mode="floor")
        away = unique[owner_node != topology.node_of(rank)]
        flat += int(away.numel())
        per_node[topology.node_of(rank)].update(away.tolist())
    return flat, sum(len(s) for s in per_node)


def measure(models: Sequence[str], shapes: Sequence[Tuple[int, int]], steps: int, data: Path,
            cache: Path, tokens_per_rank: Sequence[Optional[int]] = (None,)) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per model and shape ``NxK``: the flat and node-aware inter-node ids per step, and their ratio.
    ``tokens_per_rank``: batch sizes to try (None: the workload's own; others are keyed
    ``NxK @T``), fairseq's ``--max-tokens`` for translation, whole blocks for the LM."""
    from embrace_fairseq.perf.bench.workloads import build_task_and_batches, prepare_shared_inputs, workloads

    prepare_shared_inputs(list(models), data, cache)
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for model in models:
        base = workloads(False)[model]
        for tokens in tokens_per_rank:
            w = base if tokens is None else dataclasses.replace(base, tokens_per_rank=int(tokens))
            for nodes, per_node in shapes:
                topology = NodeTopology(nodes * per_node, per_node)
                batches = build_task_and_batches(w, topology.world_size, data, cache)
                vocab = len(batches.task.source_dictionary)
                plan = ShardPlan(vocab, topology.world_size, DEFAULT_LAYOUT)
                counts = [inter_node_ids([batches.ids(s, r) for r in range(topology.world_size)], plan, topology)
                          for s in range(steps)]
                flat = statistics.fmean(c[0] for c in counts)
                node = statistics.fmean(c[1] for c in counts)
                key = f"{nodes}x{per_node}" + ("" if tokens is None else f" @{tokens}")
                out.setdefault(model, {})[key] = {
                    "tokens_per_rank": w.tokens_per_rank, "flat_ids_per_step": flat, "node_ids_per_step": node,
                    "node_over_flat": node / flat if flat else None}
    return out


def table(result: Dict[str, Dict[str, Dict[str, float]]]) -> str:
    lines = ["| model | nodes x ranks per node | tokens per rank | flat: ids across per step | node-aware | node-aware / flat |",
             "|---|---|---|---|---|---|"]
    for model, per in result.items():
        for shape, r in per.items():
            ratio = "-" if r["node_over_flat"] is None else f"{r['node_over_flat']:.2f}"
            lines.append(f"| {model} | {shape.split(' @')[0]} | {r.get('tokens_per_rank', '-')} | "
                         f"{r['flat_ids_per_step']:.0f} | {r['node_ids_per_step']:.0f} | {ratio} |")
    return "\n".join(lines)


def _shape(text: str) -> Tuple[int, int]:
    nodes, per = text.lower().split("x")
    return int(nodes), int(per)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.node_dedup", description=__doc__.split("\n\n")[1])
    p.add_argument("--models", default="lm,translation")
    p.add_argument("--shapes", default="2x2,2x4,4x4,2x8", help="comma list of NODESxRANKS_PER_NODE")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens-per-rank", default=None,
                   help="comma list of batch sizes per rank to compare (default: the benchmark's own)")
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = p.parse_args(argv)
    cache = Path(tempfile.gettempdir()) / "embrace_bench_cache"
    tokens = [int(t) for t in a.tokens_per_rank.split(",")] if a.tokens_per_rank else [None]
    result = measure(a.models.split(","), [_shape(s) for s in a.shapes.split(",")], a.steps, a.data, cache, tokens)
    print(table(result))
    if a.json is not None:
        from embrace_fairseq.perf.provenance import source_state

        a.json.write_text(json.dumps({"source": source_state(REPO_ROOT), "command": "python -m "
                                      "embrace_fairseq.perf.node_dedup " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
                                      "steps": a.steps, "result": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
