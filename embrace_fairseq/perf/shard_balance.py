"""How evenly each shard layout spreads the embedding exchange over the ranks.

``python -m embrace_fairseq.perf.shard_balance [--data data] [--worlds 2 4 8] [--steps 20]``

For every world size and layout (:data:`~embrace_fairseq.core.shard_plan.LAYOUTS`) it
builds the :class:`~embrace_fairseq.core.shard_plan.ShardPlan` of a real fairseq
dictionary, takes the ids each rank looks up in real fairseq batches, and counts the
rows the exchange moves, exactly as it would move them: the ids go through the
exchange's own dedup and bucketing (``native_ops.dedup_bucket`` on plan-order ids, as
:func:`~embrace_fairseq.core.input_dist.plan_exchange` does), and the bytes are those
:mod:`~embrace_fairseq.core.output_dist` records. No collective runs.

Per exchange phase:

* ``rows`` (forward): an owner *sends* the rows the other ranks asked of it, a
  requester *receives* the rows it asked of others;
* ``grad_rows`` (backward): the mirror, requesters send gradient rows, owners receive them.

An AlltoAll waits for its busiest link, so the figures are ``busiest / mean``: per step,
the busiest rank's bytes over the mean rank's, summed over the steps (the time the
steps' AlltoAlls wait scales with the sum); 1.0 is a perfect balance. The *owner* side
(rows sent in forward, gradient rows received in backward) is what the layout decides:
with contiguous ranges rank 0 owns the frequent words and serves everyone. The
*requester* side (the other direction) is each rank's own distinct ids less the ones it
owns: it follows the batches (how many distinct words each rank's batch holds), whatever
the layout. See :func:`balance`.

Data: the prepared German-English data (``<data>/deen/bin``, the benchmark's translation
workload: fairseq's joint dictionary, ``batch_by_size`` batches of 512 tokens per rank)
when present; otherwise a corpus with natural language's word frequencies (Zipf,
exponent 1, 8000 word types, a fixed seed) binarised by fairseq's ``Dictionary``
(frequency-sorted, as ``fairseq-preprocess`` builds it) and batched the same way by
fairseq's ``LanguagePairDataset``. Both are what the embedding of the benchmark's
translation model sees: source tokens and previous output tokens of each batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from embrace_fairseq.core import native_ops
from embrace_fairseq.core.shard_plan import LAYOUTS, ShardPlan

PHASES = ("rows", "grad_rows")
GOAL = 1.15


# ---------------------------------------------------------------------- what the exchange moves


def send_counts(ids: torch.Tensor, plan: ShardPlan) -> List[int]:
    """Unique ids a rank asks of each owner: the exchange's own dedup and bucketing."""
    bucketed = native_ops.dedup_bucket(plan.to_plan(ids.reshape(-1)), plan.boundaries)
    if bucketed.bad_id is not None:
        raise ValueError(f"id {bucketed.bad_id} outside the table of {plan.num_embeddings} rows")
    return list(bucketed.send_counts)


@dataclass
class StepBytes:
    """Bytes each rank sends and receives in one step, per phase."""

    sent: Dict[str, List[int]] = field(default_factory=dict)
    received: Dict[str, List[int]] = field(default_factory=dict)


def step_bytes(ids_per_rank: Sequence[torch.Tensor], plan: ShardPlan, row_bytes: int) -> StepBytes:
    """What ``output_dist`` records for one exchange (bytes that leave a rank only)."""
    n = plan.world_size
    counts = [send_counts(ids, plan) for ids in ids_per_rank]  # counts[requester][owner]
    serve = [sum(counts[r][o] for r in range(n) if r != o) * row_bytes for o in range(n)]
    ask = [sum(counts[r][o] for o in range(n) if o != r) * row_bytes for r in range(n)]
    return StepBytes(sent={"rows": serve, "grad_rows": ask}, received={"rows": ask, "grad_rows": serve})


def balance(steps: Sequence[StepBytes], phase: str) -> Dict[str, float]:
    """Busiest rank over the mean rank in one phase, per step, summed over the steps.

    ``owners``: the side the layout decides, rows sent in forward and gradient rows
    received in backward (the goal applies to it); ``requesters``: rows received in
    forward and gradient rows sent in backward, which is each rank's own unique ids
    less those it owns, so it follows how many distinct words each rank's batch holds;
    ``busiest_link``: the larger of a rank's sent and received bytes. Sent and received
    means are equal (every byte sent is received), so all share one denominator.
    """
    owner_side = (lambda s: s.sent[phase]) if phase == "rows" else (lambda s: s.received[phase])
    req_side = (lambda s: s.received[phase]) if phase == "rows" else (lambda s: s.sent[phase])
    mean = sum(statistics.fmean(s.sent[phase]) for s in steps)

    def ratio(x: float) -> float:
        return x / mean if mean else 1.0

    totals = [sum(owner_side(s)[r] for s in steps) for r in range(len(steps[0].sent[phase]))]
    return {
        "owners_max_over_mean": ratio(sum(max(owner_side(s)) for s in steps)),
        "requesters_max_over_mean": ratio(sum(max(req_side(s)) for s in steps)),
        "busiest_link_over_mean": ratio(sum(max(max(s.sent[phase]), max(s.received[phase])) for s in steps)),
        "owners_run_total_max_over_mean": max(totals) / statistics.fmean(totals) if sum(totals) else 1.0,
        "mean_bytes_per_step": mean / len(steps),
        "owner_side_bytes_per_rank": totals,
    }


# ---------------------------------------------------------------------- batches


@dataclass
class BatchSource:
    """The ids rank ``r`` looks up at step ``s`` for a world size, and the table size."""

    description: str
    vocab: int
    ids: Callable[[int, int, int], torch.Tensor]  # (world, step, rank) -> ids


def _prepared(data: Path, cache: Path) -> Optional[BatchSource]:
    if not (data / "deen" / "bin" / "dict.de.txt").exists():
        return None
    from embrace_fairseq.perf.bench import workloads as W

    w = W.workloads(False)["translation"]
    built: Dict[int, Any] = {}

    def ids(world: int, step: int, rank: int) -> torch.Tensor:
        if world not in built:
            built[world] = W.build_task_and_batches(w, world, data, cache)
        return built[world].ids(step, rank)

    first = W.build_task_and_batches(w, 1, data, cache)
    built[1] = first
    return BatchSource(f"prepared German-English data ({data / 'deen' / 'bin'}), fairseq batches of "
                       f"{w.tokens_per_rank} tokens per rank", len(first.task.source_dictionary), ids)


def zipf_corpus(types: int = 8000, sentences: int = 20000, exponent: float = 1.0, seed: int = 1,
                min_len: int = 4, max_len: int = 40) -> List[List[str]]:
    """Sentences of words drawn with natural language's frequencies (Zipf's law)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, types + 1, dtype=torch.float64).pow(-exponent)
    lengths = torch.randint(min_len, max_len + 1, (sentences,), generator=g).tolist()
    words = torch.multinomial(weights / weights.sum(), sum(lengths), replacement=True, generator=g).tolist()
    out, pos = [], 0
    for n in lengths:
        out.append([f"w{k}" for k in words[pos:pos + n]])
        pos += n
    return out


def _synthetic(tokens_per_rank: int = 512, seed: int = 1) -> BatchSource:
    from fairseq.data import Dictionary, LanguagePairDataset, data_utils

    corpus = zipf_corpus(seed=seed)
    d = Dictionary()
    for sent in corpus:  # as fairseq-preprocess --joined-dictionary: counts, then sorted by frequency
        for w in sent:
            d.add_symbol(w)
    d.finalize(padding_factor=8)
    enc = [torch.tensor([d.index(w) for w in s] + [d.eos()], dtype=torch.long) for s in corpus]
    half = len(enc) // 2
    src, tgt = enc[:half], enc[half:2 * half]
    pairs = LanguagePairDataset(src, torch.tensor([len(t) for t in src]).numpy(), d,
                                tgt, torch.tensor([len(t) for t in tgt]).numpy(), d,
                                left_pad_source=True, left_pad_target=False)
    with data_utils.numpy_seed(seed):
        order = pairs.ordered_indices()
    batches = [list(b) for b in pairs.batch_by_size(order, max_tokens=tokens_per_rank)]
    g = torch.Generator().manual_seed(seed)
    batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]

    def ids(world: int, step: int, rank: int) -> torch.Tensor:
        b = pairs.collater([pairs[i] for i in batches[(step * world + rank) % len(batches)]])
        return torch.cat([b["net_input"]["src_tokens"].reshape(-1), b["net_input"]["prev_output_tokens"].reshape(-1)])

    return BatchSource(f"Zipf corpus (8000 word types, exponent 1, fairseq Dictionary of {len(d)} symbols), fairseq "
                       f"batches of {tokens_per_rank} tokens per rank", len(d), ids)


def batch_source(data: Optional[Path] = None, cache: Optional[Path] = None) -> BatchSource:
    """The prepared data when present, the Zipf corpus otherwise."""
    if data is not None:
        src = _prepared(Path(data), Path(cache) if cache else Path(data) / "cache")
        if src is not None:
            return src
    return _synthetic()


# ---------------------------------------------------------------------- report


def measure(source: BatchSource, worlds: Sequence[int] = (2, 4, 8), steps: int = 20, dim: int = 256,
            layouts: Sequence[str] = LAYOUTS, element_size: int = 4) -> Dict[str, Any]:
    """``{layout: {world: {phase: balance}}}`` for the source's batches."""
    from embrace_fairseq.perf.provenance import source_state

    out: Dict[str, Any] = {**source_state(), "source": source.description, "vocab": source.vocab, "dim": dim, "steps": steps,
                           "goal": GOAL, "layouts": {}}
    for layout in layouts:
        per_world = {}
        for world in worlds:
            plan = ShardPlan(source.vocab, world, layout)
            recs = [step_bytes([source.ids(world, s, r) for r in range(world)], plan, dim * element_size)
                    for s in range(steps)]
            per_world[str(world)] = {phase: balance(recs, phase) for phase in PHASES}
        out["layouts"][layout] = per_world
    return out


def table(result: Dict[str, Any]) -> str:
    lines = [f"Data: {result['source']}; table {result['vocab']} x {result['dim']} fp32; "
             f"{result['steps']} steps per world size.",
             "Per step, the busiest rank's bytes over the mean rank's, summed over the steps. owners: rows sent in "
             "forward, gradient rows received in backward (what the layout decides; goal <= {:.2f} for the balanced "
             "layout). requesters: the other direction, set by how many distinct ids each rank's batch holds. "
             "link: the larger of the two per rank.".format(result["goal"]), "",
             "| layout | ranks | phase | owners max/mean | requesters max/mean | link max/mean | "
             "owners, run total max/mean | mean KB/step |",
             "|---|---|---|---|---|---|---|---|"]
    for layout, per_world in result["layouts"].items():
        for world, phases in per_world.items():
            for phase, b in phases.items():
                lines.append(f"| {layout} | {world} | {phase} | {b['owners_max_over_mean']:.3f} | "
                             f"{b['requesters_max_over_mean']:.3f} | {b['busiest_link_over_mean']:.3f} | "
                             f"{b['owners_run_total_max_over_mean']:.3f} | {b['mean_bytes_per_step'] / 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.shard_balance",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data", help="prepared data folder (uses <data>/deen/bin when present)")
    ap.add_argument("--cache", default=None, help="cache folder for the prepared data (default <data>/cache)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    result = measure(batch_source(Path(args.data), args.cache), args.worlds, args.steps, args.dim)
    result["command"] = "python -m embrace_fairseq.perf.shard_balance " + " ".join(
        sys.argv[1:] if argv is None else argv)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for layout, per_world in result["layouts"].items():
        worst = max(b["owners_max_over_mean"] for phases in per_world.values() for b in phases.values())
        print(f"{layout}: worst owners max/mean {worst:.3f}" + (f" (goal <= {GOAL})" if layout == "strided" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
