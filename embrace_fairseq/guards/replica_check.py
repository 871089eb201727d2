"""Do the replicated (dense) weights agree on every rank? A cheap all-gather of digests.

Data-parallel training keeps every dense parameter bit-identical on all ranks; a
rank that skipped a step alone, or applied a gradient the others did not, drifts
apart silently. :func:`check_replicas_agree` hashes the dense parameters of a module
(table shards excluded: they differ by design) and compares the digests.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import is_sharded_param


class ReplicaDivergenceError(RuntimeError):
    """Replicated parameters differ between ranks."""


def dense_digest(module: torch.nn.Module) -> str:
    """SHA-1 over the names, shapes and bytes of every replicated parameter."""
    h = hashlib.sha1()
    for name, p in module.named_parameters():
        if is_sharded_param(p):
            continue
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_replicas_agree(module: torch.nn.Module, group: Optional["dist.ProcessGroup"] = None) -> List[str]:
    """Collective: every rank's digest; raises :class:`ReplicaDivergenceError` on every
    rank when they differ, naming the ranks of each digest."""
    digest = dense_digest(module)
    if collectives.world_size(group) == 1:
        return [digest]
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
    gathered = collectives.all_gather(mine, group)
    digests = [bytes(t.tolist()).hex() for t in gathered]
    if len(set(digests)) > 1:
        by_value = {}
        for r, d in enumerate(digests):
            by_value.setdefault(d, []).append(r)
        raise ReplicaDivergenceError(
            "replicated weights differ between ranks: "
            + "; ".join(f"ranks {','.join(map(str, rs))} hold {d[:12]}" for d, rs in by_value.items())
        )
    return digests
