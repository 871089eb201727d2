"""Per-rank bodies of the overlapped tied-table tests (spawned in real gloo ranks).

A tied model (lookup -> 2 layers -> projection onto the same table) is trained three
ways from the same seed and batches: a replicated table with averaged gradients (the
reference), a sharded table with the synchronous full-table exchange, and a sharded
table with the overlapped one (gather issued at the lookup, reduce-scatter finished
before the optimizer reads ``.grad``).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq import CommLedger, ShardedEmbedding, fairseq_initial_table
from embrace_fairseq.core.sharded_embedding import finish_pending

DIM, HIDDEN, BATCH, SEQ = 16, 24, 4, 6


class TiedLM(nn.Module):
    def __init__(self, vocab, mode, ledger=None):
        super().__init__()
        torch.manual_seed(4321)
        self.vocab, self.mode = vocab, mode
        if mode == "replicated":
            self.emb = nn.Embedding(vocab, DIM, padding_idx=1, _weight=fairseq_initial_table(vocab, DIM, 1))
        else:
            self.emb = ShardedEmbedding(vocab, DIM, padding_idx=1, ledger=ledger, overlap_table=(mode == "overlap"))
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, ids, target):
        h = self.fc2(torch.tanh(self.fc1(self.emb(ids))))
        w = self.emb.weight if self.mode == "replicated" else self.emb.gathered_weight()
        logits = h @ w.t()
        return F.cross_entropy(logits.reshape(-1, self.vocab), target.reshape(-1))

    def full_state(self):
        out = {}
        for name, p in self.named_parameters():
            t = self.emb.full_weight() if (self.mode != "replicated" and p is self.emb.weight) else p.detach()
            out[name] = t.numpy().copy()
        return out


def _batch(step, rank, vocab):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _train(rank, world, vocab, mode, steps, accum, clip):
    ledger = CommLedger()
    model = TiedLM(vocab, mode, ledger)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, pending_after_backward, grad_before_finish = [], [], []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            ids, tgt = _batch(step * accum + micro, rank, vocab)
            loss = model(ids, tgt) / accum
            loss.backward()
            losses.append(float(loss.detach()))
            if mode == "overlap":
                pending_after_backward.append(len(model.emb._table_grads))
        if mode == "overlap":
            # the lookup's rows arrived through autograd; the projection's part is still in flight
            grad_before_finish.append(None if model.emb.weight.grad is None else model.emb.weight.grad.clone())
        finish_pending(model)
        dense = [p for p in model.parameters() if p.grad is not None and (mode == "replicated" or p is not model.emb.weight)]
        dense_ids = {id(p) for p in dense}
        for p in dense:  # data-parallel average of replicated gradients
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        if clip:
            # norm over the full table: each rank's shard counted once
            sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None and id(p) not in dense_ids)
            t = torch.tensor([sq])
            if mode != "replicated":
                dist.all_reduce(t)
            sq_dense = sum(float(p.grad.pow(2).sum()) for p in dense)
            coef = min(1.0, clip / ((float(t) + sq_dense) ** 0.5 + 1e-6))
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        opt.step()
    grad_gap = None
    if mode == "overlap":
        # how much of the table gradient was still missing before finish_pending (0 = not deferred)
        before = grad_before_finish[-1]
        final = model.emb.weight.grad
        grad_gap = float((final - (torch.zeros_like(final) if before is None else before)).abs().sum())
    return {
        "losses": losses,
        "state": model.full_state(),
        "pending": pending_after_backward,
        "bytes": {k: ledger.sent.get(k, 0) for k in ("table_gather", "table_grad")},
        "grad_gap": grad_gap,
    }


def tied_training(rank, world, vocab, steps=4, accum=1, clip=0.0):
    torch.set_num_threads(1)
    return {mode: _train(rank, world, vocab, mode, steps, accum, clip) for mode in ("replicated", "sync", "overlap")}


def prefetch_freshness(rank, world, vocab):
    """A gather issued before the weights change is never served: load_full_weight and
    finish_pending drop it, and an in-place change behind its back is detected."""
    torch.set_num_threads(1)
    emb = ShardedEmbedding(vocab, DIM, overlap_table=True)
    out = {}
    emb.prefetch_table()
    new = torch.arange(vocab * DIM, dtype=torch.float32).view(vocab, DIM)
    emb.load_full_weight(new)
    out["after_load"] = float((emb.gathered_weight().detach() - new).abs().max())
    emb.prefetch_table()
    with torch.no_grad():
        emb.weight.add_(1.0)  # e.g. an optimizer step
    out["after_inplace"] = float((emb.gathered_weight().detach() - (new + 1)).abs().max())
    emb.prefetch_table()
    finish_pending([emb])
    out["dropped_by_finish"] = emb._pending_gather is None
    with torch.no_grad():
        emb.weight.add_(1.0)
    out["after_finish"] = float((emb.gathered_weight().detach() - (new + 2)).abs().max())
    return out


def quick_suite(rank, world, vocab):
    """The default-suite checks in one spawn: training with accumulation and clipping,
    and freshness of the prefetched table."""
    return {"training": tied_training(rank, world, vocab, 4, 2, 0.05), "fresh": prefetch_freshness(rank, world, 11)}
