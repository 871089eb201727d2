"""Per-rank body of the gradient check and norm test, spawned in real gloo ranks."""
from __future__ import annotations

import torch

from embrace_fairseq.optim.grad_norm import combine_norms, nonfinite_and_norm, nonfinite_gradients, sharded_sq_norm


def grads(rank: int, case: str):
    """(name, grad) and the shard flags: a replicated weight and bias (the same on every
    rank), this rank's shard of a table (its own draw), a parameter without gradient."""
    g = torch.Generator().manual_seed(5)
    dense_w, dense_b = torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
    shard = torch.randn(2 + rank, 3, generator=torch.Generator().manual_seed(100 + rank))
    if case == "nan" and rank == 2:
        shard[0, 1] = float("nan")
    if case == "overflow" and rank == 1:
        shard[:] = 3e38  # finite, but the float32 norm overflows
    return [("fc.weight", dense_w), ("fc.bias", dense_b), ("emb.weight", shard), ("frozen", None)], [False, False, True, False]


def check_and_norm(rank: int, world: int):
    out = {}
    for case in ("finite", "nan", "overflow"):
        named, sharded = grads(rank, case)
        found, norm = nonfinite_and_norm(named, sharded)
        # the two separate collectives it replaces
        old_found = nonfinite_gradients(named)
        dense = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for (_, g), s in zip(named, sharded)
                                                      if g is not None and not s]))
        old_norm = combine_norms(dense, sharded_sq_norm([g for (_, g), s in zip(named, sharded) if s]))
        out[case] = {"found": found, "norm": float(norm), "old_found": old_found, "old_norm": float(old_norm)}
    return out
