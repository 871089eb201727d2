"""Per-rank bodies of the core fault scenarios (spawned in real gloo ranks by run_ranks)."""
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq import ShardedEmbedding, fairseq_initial_table
from embrace_fairseq.optim.grad_norm import combine_norms, sharded_sq_norm
from embrace_fairseq.guards.replica_check import check_replicas_agree, dense_digest
from embrace_fairseq.core.sharded_embedding import is_sharded_param

VOCAB, DIM, HIDDEN = 23, 8, 12


class TinyModel(nn.Module):
    """A (sharded or replicated) table, a dense layer and a projection to the vocab."""

    def __init__(self, sharded: bool, vocab: int = VOCAB, dim: int = DIM):
        super().__init__()
        torch.manual_seed(11)
        if sharded:
            self.emb = ShardedEmbedding(vocab, dim, padding_idx=1)
        else:
            self.emb = nn.Embedding(vocab, dim, padding_idx=1, _weight=fairseq_initial_table(vocab, dim, 1))
        self.fc = nn.Linear(dim, HIDDEN)
        self.out = nn.Linear(HIDDEN, vocab)

    def loss(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # a sum, not a mean: an empty batch contributes exactly zero
        logits = self.out(torch.tanh(self.fc(self.emb(ids))))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum") / 16.0

    def full_table(self) -> torch.Tensor:
        return self.emb.full_weight() if isinstance(self.emb, ShardedEmbedding) else self.emb.weight.detach().clone()


def batch(step: int, rank: int, size: int, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, vocab, (size, 5), generator=g), torch.randint(0, vocab, (size, 5), generator=g)


def _average_dense_grads(model: nn.Module, world: int) -> None:
    for p in model.parameters():
        if p.grad is not None and not is_sharded_param(p):
            dist.all_reduce(p.grad)
            p.grad /= world


def train_steps(rank, world, *, steps, sizes, sharded=True, slow_rank=None, slow_s=0.0, inf_at=None):
    """SGD training; ``sizes(step, rank)`` gives each rank's batch size (0 = empty).

    ``slow_rank`` is slow *inside* every step: it sleeps ``slow_s / 2`` before its forward
    exchange and ``slow_s / 2`` before its backward (gradient) exchange, so the other
    ranks wait for it in those collectives; ``step_times`` shows it.

    The replicated reference (``sharded=False``) averages the table's gradient with an
    all-reduce, as DDP does. ``inf_at=(step, rank)`` puts inf into that rank's shard
    gradient; every rank then skips the step when the global norm is not finite.
    Returns losses, the full table, the dense digest and what each step did.
    """
    model = TinyModel(sharded)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses, actions, step_s = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        ids, tgt = batch(step, rank, sizes(step, rank))
        opt.zero_grad()
        if rank == slow_rank:
            time.sleep(slow_s / 2)  # late for the forward exchange
        loss = model.loss(ids, tgt)
        if rank == slow_rank:
            time.sleep(slow_s / 2)  # late for the gradient exchange
        loss.backward()
        if inf_at is not None and step == inf_at[0] and rank == inf_at[1]:
            model.emb.weight.grad[0, 0] = float("inf")
        _average_dense_grads(model, world)
        if not sharded:
            dist.all_reduce(model.emb.weight.grad)
            model.emb.weight.grad /= world
        dense = [p.grad for p in model.parameters() if p.grad is not None and not is_sharded_param(p)]
        shard = [p.grad for p in model.parameters() if p.grad is not None and is_sharded_param(p)]
        dense_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense]))
        total = combine_norms(dense_norm, sharded_sq_norm(shard))
        if torch.isfinite(total):
            opt.step()
            actions.append("step")
        else:
            actions.append("skip")
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(float(summed))
        step_s.append(time.perf_counter() - t0)
    check_replicas_agree(model)  # raises on every rank if the dense weights drifted apart
    return {
        "losses": losses,
        "actions": actions,
        "table": model.full_table().numpy().copy(),
        "digest": dense_digest(model),
        "step_s": sum(step_s),
        "step_times": step_s,
    }


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("ok", "", time.monotonic() - t0)


def startup_checks(rank, world, bad_rank):
    """Rank ``bad_rank`` builds its table from another vocabulary, then another embedding
    size; then its dense weights alone move. Each must be an error on every rank."""
    out = {}
    for field in ("same", "vocab", "dim"):
        vocab, dim = VOCAB, DIM
        if rank == bad_rank and field == "vocab":
            vocab += 8
        if rank == bad_rank and field == "dim":
            dim *= 2
        out[field] = _outcome(lambda: ShardedEmbedding(vocab, dim, padding_idx=1))
    model = TinyModel(True)
    if rank == bad_rank:
        with torch.no_grad():
            model.fc.bias.add_(1e-3)
    out["replicas"] = _outcome(lambda: check_replicas_agree(model))
    return out


def soak(rank, world, *, steps, warmup, seed=0):
    """Many steps with random batch sizes (empty ones included); RSS before and after."""
    import gc
    import random

    import psutil

    proc = psutil.Process()
    model = TinyModel(True, vocab=1000, dim=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = random.Random(seed * 1000 + rank)
    rss_warm, empty = None, 0
    t0 = time.monotonic()
    for step in range(steps):
        size = rng.choice([0, 0, 1, 2, 4, 8, 16, 32])
        empty += size == 0
        ids, tgt = batch(step, rank, size, vocab=1000)
        opt.zero_grad()
        model.loss(ids, tgt).backward()
        _average_dense_grads(model, world)
        opt.step()
        if step + 1 == warmup:
            gc.collect()
            rss_warm = proc.memory_info().rss
    gc.collect()
    check_replicas_agree(model)
    return {"rss_warm": rss_warm, "rss_end": proc.memory_info().rss, "empty": empty,
            "seconds": time.monotonic() - t0}
