"""Demonstration: a sharded table matches a replicated one, and moves far fewer bytes.

``python -m embrace_fairseq.perf.demo [--ranks 2] [--vocab 32000] [--dim 512] [--tokens 4096]``
starts real gloo ranks on this machine, runs one training step of a ShardedEmbedding
and of a replicated ``nn.Embedding`` (gradients averaged with all-reduce, as DDP does),
checks they agree, and compares the bytes the AlltoAll exchange sent (as recorded)
with what a ring all-reduce of the whole table sends.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict

import torch
import torch.distributed as dist

from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.ring_volume import ring_allreduce_bytes
from embrace_fairseq.tools.local_ranks import run_ranks
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding


def _zipf_batch(vocab: int, tokens: int, rank: int) -> torch.Tensor:
    # Natural text is Zipfian: a batch touches a small share of a large vocabulary.
    g = torch.Generator().manual_seed(100 + rank)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = 1.0 / ranks
    return torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=g).view(-1, 64)


def _rank_step(rank: int, world: int, vocab: int, dim: int, tokens: int) -> Dict[str, float]:
    torch.manual_seed(0)
    ledger = CommLedger()
    sharded = ShardedEmbedding(vocab, dim, padding_idx=1, ledger=ledger)
    replicated = torch.nn.Parameter(sharded.full_weight())  # same initial table
    ledger.reset()
    ids = _zipf_batch(vocab, tokens, rank)
    coef = torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(rank))
    out = sharded(ids)
    (out * coef).sum().backward()
    ref = torch.nn.functional.embedding(ids, replicated, padding_idx=1)
    (ref * coef).sum().backward()
    grad = replicated.grad
    dist.all_reduce(grad)
    grad /= world
    elem = replicated.element_size()
    return {
        "forward_max_abs_diff": (out - ref).abs().max().item(),
        "grad_max_abs_diff": (sharded.weight.grad - sharded.shard_of(grad)).abs().max().item(),
        "unique_ids": int(ids.unique().numel()),
        "embrace_bytes_sent": ledger.total_sent(),
        "embrace_bytes_by_kind": dict(ledger.sent),
        "dense_allreduce_bytes_sent": ring_allreduce_bytes(vocab * dim * elem, world),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (multiple of 64)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    results = run_ranks(_rank_step, a.ranks, a.vocab, a.dim, a.tokens)
    ok = all(r["forward_max_abs_diff"] == 0.0 and r["grad_max_abs_diff"] < 1e-6 for r in results)
    print(f"EmbRace demonstration: {a.ranks} gloo ranks, table {a.vocab} x {a.dim} fp32, {a.tokens} tokens per rank")
    for rank, r in enumerate(results):
        ratio = r["dense_allreduce_bytes_sent"] / max(r["embrace_bytes_sent"], 1)
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(r["embrace_bytes_by_kind"].items()))
        print(
            f"  rank {rank}: {r['unique_ids']} unique ids; forward diff {r['forward_max_abs_diff']:.1e}, "
            f"grad diff {r['grad_max_abs_diff']:.1e}; sent {r['embrace_bytes_sent']:,} B ({kinds}) vs dense "
            f"all-reduce {r['dense_allreduce_bytes_sent']:,.0f} B: {ratio:.1f}x less"
        )
    print("sharded == replicated:", "yes" if ok else "NO")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ranks": results, "match": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
