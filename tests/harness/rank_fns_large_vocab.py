"""Per-rank body of the real-vocabulary-size test (tests/core/test_large_vocab.py).

A small model on the project's own path: a :class:`ShardedEmbedding` of XLM-R's / mBART's
vocabulary size, one dense layer, the tied output layer read vocab-parallel
(:class:`TiedShardedProjection` returning the marker, the loss over the shards), the table
stepped by :class:`ShardOptimizer` (Adam), the dense layer by plain SGD after an all-reduce
(``torch.optim`` is left out: its first use imports a large part of torch, which would
blur the resident-memory measurement and cost a second per rank). Everything the rank holds and every tensor it produces while training is
measured, not derived from the shard plan.
"""
from __future__ import annotations

import gc
import os
import resource
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.tied_projection import TiedShardedProjection
from embrace_fairseq.core.vocab_parallel import label_smoothed_loss
from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer

EPS = 0.1  # label smoothing
PAD = 1


class TensorRecorder(TorchDispatchMode):
    """Every tensor an operator returns while active: (operator, shape, dtype).

    Below autograd, so it sees the forward, the backward (which runs on this thread for
    CPU tensors) and the optimizer step, including the operators called inside autograd
    Functions and collectives. A tensor that was never the output of an operator cannot be
    allocated, so a full-vocabulary logits tensor cannot escape it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tuple[str, Tuple[int, ...], torch.dtype, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func.overloadpacket.__name__), tuple(t.shape), t.dtype, t._is_view()))
        return out

    def wider_than(self, rows: int, floating: bool) -> List[Tuple[str, Tuple[int, ...], str]]:
        """Recorded tensors with a dimension longer than ``rows`` (floating point, or integer)."""
        return [(op, shape, str(dtype)) for op, shape, dtype, _ in self.seen
                if dtype.is_floating_point == floating and any(d > rows for d in shape)]


def _fix_mmap_threshold(nbytes: int) -> None:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, nbytes)``: blocks from ``nbytes`` on are mmap'ed,
    and the threshold no longer rises as large blocks are freed. Called in the rank: the
    ``MALLOC_MMAP_THRESHOLD_`` variable is read when a process starts, and a local rank
    is forked from a server that started earlier."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    if ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _anon_rss_bytes() -> int:
    """Resident anonymous memory (``RssAnon``): the heap and mmap'ed tensors, not the
    pages of shared libraries that the first use of an operator faults in."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class TinyTiedLM(nn.Module):
    def __init__(self, vocab: int, dim: int, output: str) -> None:
        super().__init__()
        self.embed = ShardedEmbedding(vocab, dim, padding_idx=PAD)
        self.dense = nn.Linear(dim, dim)
        self.out = TiedShardedProjection(self.embed, mode=output)
        self.out.enable_vocab_parallel(True)

    def forward(self, ids: torch.Tensor):
        return self.out(torch.tanh(self.dense(self.embed(ids))))


def _batch(rank: int, step: int, vocab: int, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(2, vocab, (tokens,), generator=g)
    target = torch.randint(2, vocab, (tokens,), generator=g)
    return ids, target


def _loss(model: TinyTiedLM, ids: torch.Tensor, target: torch.Tensor):
    """(loss, features) of one forward: vocab-parallel via the marker, or (gather mode)
    fairseq's stock computation from full logits."""
    out = model(ids)
    vocab = model.embed.num_embeddings
    if isinstance(out, torch.Tensor):  # the gather path: full logits
        lprobs = F.log_softmax(out.float(), dim=-1)
        nll = -lprobs.gather(1, target.unsqueeze(1)).sum()
        return label_smoothed_loss(nll, -lprobs.sum(), EPS, vocab), None
    res = out.loss(out.features, target, smoothing=True, accuracy=False)
    assert res is not None, "the output layer did not take the vocab-parallel path"
    return label_smoothed_loss(res.nll.sum(), res.smooth.sum(), EPS, vocab), out.features


def _reference_loss(full_table: torch.Tensor, features: torch.Tensor, target: torch.Tensor) -> float:
    lprobs = F.log_softmax(F.linear(features.detach(), full_table), dim=-1)
    nll = -lprobs.gather(1, target.unsqueeze(1)).sum()
    return float(label_smoothed_loss(nll, -lprobs.sum(), EPS, full_table.shape[0]))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Trainer:
    """The model, its two optimizers and one training step (forward, backward, dense
    all-reduce, optimizer steps)."""

    def __init__(self, rank: int, world: int, vocab: int, dim: int, output: str) -> None:
        torch.manual_seed(0)
        self.rank, self.world, self.vocab = rank, world, vocab
        self.model = TinyTiedLM(vocab, dim, output)
        self.emb = self.model.embed
        self.hp = HyperParams(lr=1e-3)
        self.table_opt: ShardOptimizer = None  # type: ignore[assignment]
        self.tokens = tokens_of(rank)

    def make_table_optimizer(self) -> None:
        self.table_opt = ShardOptimizer([self.emb.weight], "adam")  # allocates exp_avg, exp_avg_sq

    def forward_backward(self, step: int):
        ids, target = _batch(self.rank, step, self.vocab, self.tokens)
        self.model.zero_grad(set_to_none=True)
        loss, features = _loss(self.model, ids, target)
        loss.backward()
        return float(loss.detach()), features, target

    def optimizer_step(self) -> None:
        self.table_opt.step(self.hp)
        with torch.no_grad():  # the dense layer: data-parallel average, plain SGD
            for p in self.model.dense.parameters():
                collectives.all_reduce(p.grad)
                p.add_(p.grad, alpha=-self.hp.lr / self.world)

    def held(self) -> Dict[str, int]:
        """Bytes of the storages of the table, its gradient and its Adam moments."""
        st = self.table_opt.state[0]
        return {"table": _storage(self.emb.weight), "grad": _storage(self.emb.weight.grad),
                "exp_avg": _storage(st["exp_avg"]), "exp_avg_sq": _storage(st["exp_avg_sq"])}

    def largest_held_rows(self) -> int:
        """Rows of the largest tensor the model and both optimizers hold (weights,
        gradients, optimizer state): nothing but the shard may be table-sized."""
        tensors = [*self.model.parameters(), *self.model.buffers(),
                   *(p.grad for p in self.model.parameters() if p.grad is not None),
                   *(t for st in self.table_opt.state for t in st.values())]
        return max(t.shape[0] for t in tensors if t.dim() > 0)


def tokens_of(rank: int) -> int:
    return 40 + 8 * rank  # uneven token counts over the ranks


def measure_memory(rank: int, world: int, vocab: int, dim: int, steps: int = 2) -> Dict[str, Any]:
    """What this rank holds (storage bytes) and how its resident memory grows (``RssAnon``),
    from before the model exists: after building it (the table), after building the table's
    optimizer (its two moments), after training steps with the last gradient kept.

    glibc's mmap threshold is fixed first (:func:`_fix_mmap_threshold`): freed large blocks
    then go back to the system instead of staying in the heap, where resident memory would
    show what was freed as well as what is held."""
    _fix_mmap_threshold(131072)
    gc.collect()
    base = _anon_rss_bytes()
    trainer = Trainer(rank, world, vocab, dim, "vocab-parallel")
    gc.collect()
    rss = {"model": _anon_rss_bytes() - base}
    trainer.make_table_optimizer()
    rss["optimizer"] = _anon_rss_bytes() - base
    for step in range(steps):
        trainer.forward_backward(step)
        trainer.optimizer_step()
    gc.collect()
    rss["trained"] = _anon_rss_bytes() - base
    emb = trainer.emb
    return {
        "shard_rows": emb.weight.shape[0],
        "max_shard_rows": emb.plan.max_shard_size,
        "held": trainer.held(),
        "largest_held_rows": trainer.largest_held_rows(),
        "replica": emb._replica is not None or emb._consolidated is not None,
        "rss": rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def record_training(rank: int, world: int, vocab: int, dim: int, output: str, steps: int = 2) -> Dict[str, Any]:
    """Train a fresh model ``steps`` steps with every produced tensor recorded (forward,
    backward, optimizer steps; the model is built before recording, as fairseq builds it
    before training). The first step's loss is also computed from the full table outside
    the recorder, as the reference.

    ``output="gather"`` is the planted regression: the same model with its output layer
    reading the whole table and computing full logits; the recorder must report them."""
    trainer = Trainer(rank, world, vocab, dim, output)
    trainer.make_table_optimizer()
    recorder = TensorRecorder()
    losses, reference = [], None
    for step in range(steps):
        with recorder:
            loss, features, target = trainer.forward_backward(step)
        if step == 0 and features is not None:
            reference = _reference_loss(trainer.emb.full_weight(), features, target)
        with recorder:
            trainer.optimizer_step()
        losses.append(loss)
    shard_rows = trainer.emb.weight.shape[0]
    limit = trainer.emb.plan.max_shard_size
    return {
        "losses": losses,
        "reference_loss": reference,
        "float_wider": recorder.wider_than(limit, floating=True),
        "int_wider": sorted(set(recorder.wider_than(limit, floating=False))),
        "recorded": len(recorder.seen),
        # the vocab-parallel logits buffer: every rank's tokens against this rank's rows
        "logits_buffers": sorted({shape for op, shape, dtype, view in recorder.seen
                                  if not view and dtype == torch.float32 and len(shape) == 2
                                  and shape[1] == shard_rows and shape[0] > tokens_of(rank)}),
        "tokens_all": sum(tokens_of(r) for r in range(world)),
    }


def large_vocab_run(rank: int, world: int, vocab: int, dim: int) -> Dict[str, Any]:
    """The three measurements in one process group: memory, the recorded vocab-parallel
    training, and the planted full-logits training."""
    return {"rank": rank, "memory": measure_memory(rank, world, vocab, dim),
            "vocab_parallel": record_training(rank, world, vocab, dim, "vocab-parallel"),
            "planted": record_training(rank, world, vocab, dim, "gather")}
