"""Row (vocab) sharding of an embedding table over the ranks of a process group.

The plan is pure arithmetic: it never talks to other ranks. Every rank builds the
same plan from ``(num_embeddings, world_size, layout)``, which is what lets each rank
know, without asking, who owns any id.

Layouts (which rank owns which vocabulary id; shard sizes always differ by at most one):

* ``strided`` (the default): id ``v`` lives on rank ``v % N`` at local row ``v // N``.
  fairseq dictionaries are sorted by frequency, so this spreads the frequent words
  evenly over the ranks and every rank carries about the same exchange volume;
* ``contiguous``: rank ``r`` owns one range of ids (the first ranks own the most
  frequent words, and carry most of the exchange).

*Plan order* is the permutation ``plan_index(v) = start(owner(v)) + local_index(v)``:
in plan order every owner's rows form one contiguous block ``shard_range(r)``, so the
exchange (dedup and bucketing by :attr:`ShardPlan.boundaries`, requested local rows,
the row blocks of full-table collectives) works on plan-order ids and needs nothing per
layout. Ids are mapped to plan order after validation, and full tables are permuted
between plan order and vocabulary order where they enter or leave the shards
(:meth:`ShardPlan.assemble`, :meth:`ShardPlan.to_plan_order`, :meth:`ShardPlan.shard_rows`).
Everything saved (checkpoints, optimizer state) is in vocabulary order. For the
contiguous layout the permutation is the identity and none of it costs anything.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

#: The layouts a plan can have (the flag values and the DeepSpeed ``"shard_layout"``).
LAYOUTS = ("strided", "contiguous")
#: The balanced one.
DEFAULT_LAYOUT = "strided"


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown shard layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


@dataclass(frozen=True)
class ShardPlan:
    """Shards whose sizes differ by at most one row, in one of :data:`LAYOUTS`.

    The first ``num_embeddings % world_size`` ranks hold one extra row, so any vocab
    size works with any world size (a rank may even hold zero rows when the vocab is
    smaller than the world). Sizes are the same in every layout.

    ``boundaries`` and ``shard_range`` are offsets in *plan order* (see the module doc);
    for the contiguous layout plan order is vocabulary order. :meth:`owner` and
    :meth:`local_index` take vocabulary ids.
    """

    num_embeddings: int
    world_size: int
    layout: str = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        if self.num_embeddings < 0:
            raise ValueError(f"num_embeddings must be >= 0, got {self.num_embeddings}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        check_layout(self.layout)

    @functools.cached_property
    def is_identity(self) -> bool:
        """Plan order is vocabulary order (contiguous layout, one rank, or a vocab no larger than the world)."""
        return self.layout == "contiguous" or self.world_size == 1 or self.num_embeddings <= self.world_size

    @functools.cached_property
    def boundaries(self) -> List[int]:
        """``world_size + 1`` plan-order offsets: rank ``r`` owns plan ids ``[b[r], b[r+1])``."""
        base, extra = divmod(self.num_embeddings, self.world_size)
        bounds = [0]
        for r in range(self.world_size):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        return bounds

    @property
    def sizes(self) -> List[int]:
        b = self.boundaries
        return [b[r + 1] - b[r] for r in range(self.world_size)]

    @property
    def max_shard_size(self) -> int:
        return -(-self.num_embeddings // self.world_size)

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """Plan-order range ``[start, end)`` of ``rank``'s rows (vocabulary ids for the
        contiguous layout only: see :meth:`vocab_ids`)."""
        self._check_rank(rank)
        b = self.boundaries
        return b[rank], b[rank + 1]

    def shard_size(self, rank: int) -> int:
        start, end = self.shard_range(rank)
        return end - start

    def _block_of(self, plan_ids: torch.Tensor) -> torch.Tensor:
        """Rank whose plan-order block holds each plan id (the contiguous owner)."""
        base, extra = divmod(self.num_embeddings, self.world_size)
        # The first `extra` ranks hold base+1 rows; the rest hold `base` rows.
        split = extra * (base + 1)
        ids = plan_ids.long()
        big = torch.div(ids, base + 1, rounding_mode="floor")
        if base == 0:
            return big
        small = extra + torch.div(ids - split, base, rounding_mode="floor")
        return torch.where(ids < split, big, small)

    def _starts(self, ranks: torch.Tensor) -> torch.Tensor:
        """Plan-order start of each rank's block (elementwise arithmetic)."""
        base, extra = divmod(self.num_embeddings, self.world_size)
        return ranks * base + torch.clamp(ranks, max=extra)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank that owns each vocabulary id (ids must already be in ``[0, num_embeddings)``)."""
        if self.layout == "strided":
            return torch.remainder(ids.long(), self.world_size)
        return self._block_of(ids)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each vocabulary id inside its owner's shard."""
        if self.layout == "strided":
            return torch.div(ids.long(), self.world_size, rounding_mode="floor")
        return ids.long() - self._starts(self._block_of(ids))

    def owner_of(self, vocab_id: int) -> int:
        """:meth:`owner` of one id (plain arithmetic, no tensor)."""
        if self.layout == "strided":
            return vocab_id % self.world_size
        base, extra = divmod(self.num_embeddings, self.world_size)
        split = extra * (base + 1)
        return vocab_id // (base + 1) if vocab_id < split else extra + (vocab_id - split) // base

    def local_index_of(self, vocab_id: int) -> int:
        """:meth:`local_index` of one id (plain arithmetic, no tensor)."""
        if self.layout == "strided":
            return vocab_id // self.world_size
        return vocab_id - self.shard_range(self.owner_of(vocab_id))[0]

    def to_plan(self, ids: torch.Tensor) -> torch.Tensor:
        """Plan-order id of each vocabulary id. Ids outside ``[0, num_embeddings)`` are
        returned unchanged, so a later validation still finds (and names) them. The
        identity (the tensor itself) when :attr:`is_identity`."""
        if self.is_identity:
            return ids
        ids = ids.long()
        mapped = self._starts(torch.remainder(ids, self.world_size)) + torch.div(ids, self.world_size, rounding_mode="floor")
        return torch.where((ids >= 0) & (ids < self.num_embeddings), mapped, ids)

    def to_vocab(self, plan_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary id of each plan-order id (inverse of :meth:`to_plan`)."""
        if self.is_identity:
            return plan_ids
        rank = self._block_of(plan_ids)
        return (plan_ids.long() - self._starts(rank)) * self.world_size + rank

    def vocab_ids(self, rank: int, device=None) -> torch.Tensor:
        """The vocabulary ids ``rank`` owns, in local-row order."""
        start, end = self.shard_range(rank)
        if self.is_identity:
            return torch.arange(start, end, device=device)
        return torch.arange(rank, self.num_embeddings, self.world_size, device=device)

    # ------------------------------------------------------------------ full tables
    # Strided layout: vocabulary order, padded to max_shard_size * world_size rows and
    # viewed as [max_shard_size, world_size, ...], holds rank r's local row j at [j, r]
    # (id j*N + r; the ids >= num_embeddings are the padding at the end). So every
    # permutation below is one strided copy (an interleaving copy, a cat of ``full[r::N]``),
    # never an index_select / index_copy_ (two to three times slower on CPU), and the
    # strided layout costs the same copy as the contiguous one's ``cat``.

    def shard_rows(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows (local order) of a full tensor in vocabulary order: a view
        for an identity plan, a copy otherwise."""
        if full.shape[0] != self.num_embeddings:
            raise ValueError(f"expected a full table of {self.num_embeddings} rows, got shape {tuple(full.shape)}")
        if self.is_identity:
            start, end = self.shard_range(rank)
            return full[start:end]
        self._check_rank(rank)
        return full[rank::self.world_size].contiguous()

    def to_plan_order(self, full: torch.Tensor) -> torch.Tensor:
        """A vocabulary-order full tensor in plan order (itself when :attr:`is_identity`).
        Differentiable (the gradient goes back through :meth:`to_vocab_order`)."""
        if self.is_identity:
            return full
        return _Permute.apply(full, self, False)

    def to_vocab_order(self, full: torch.Tensor) -> torch.Tensor:
        """A plan-order full tensor in vocabulary order (itself when :attr:`is_identity`).
        Differentiable (the gradient goes back through :meth:`to_plan_order`)."""
        if self.is_identity:
            return full
        return _Permute.apply(full, self, True)

    def _plan_from_vocab(self, full: torch.Tensor) -> torch.Tensor:
        return torch.cat([full[r::self.world_size] for r in range(self.world_size)], dim=0)

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The vocabulary-order full tensor from every rank's shard (``parts[r]``: rank
        ``r``'s rows in local order, possibly padded beyond its size)."""
        if self.is_identity:
            return torch.cat([p[:n] for p, n in zip(parts, self.sizes)], dim=0)
        return self._interleave(list(parts))

    def _interleave(self, blocks: List[torch.Tensor]) -> torch.Tensor:
        """Strided layout: rank blocks (local order, at least each rank's size, rows past
        it ignored) -> vocabulary order, with one copy (:class:`_Permute` carries gradients)."""
        rows, world = self.max_shard_size, self.world_size
        first = blocks[0]
        out = first.new_empty(rows, world, *first.shape[1:])  # row j*N + r is rank r's row j
        for r, (b, n) in enumerate(zip(blocks, self.sizes)):
            out[:n, r] = b[:n]  # the cells past a short shard are ids >= num_embeddings: cut below
        return out.view(rows * world, *first.shape[1:])[: self.num_embeddings]

    def fingerprint(self) -> str:
        """Short digest ranks compare at start-up to catch mismatched plans."""
        text = f"rows={self.num_embeddings};world={self.world_size};layout={self.layout};ranges={self.boundaries}"
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")


class _Permute(torch.autograd.Function):
    """Plan order <-> vocabulary order of a full tensor, with the inverse permutation as
    its backward: one copy each way (autograd through the slices would add a full-size
    zero-filled gradient per rank)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, plan: ShardPlan, to_vocab: bool):  # type: ignore[override]
        ctx.plan, ctx.to_vocab = plan, to_vocab
        return plan._interleave(list(full.split(plan.sizes, dim=0))) if to_vocab else plan._plan_from_vocab(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        back = plan._plan_from_vocab(grad) if ctx.to_vocab else plan._interleave(list(grad.split(plan.sizes, dim=0)))
        return back, None, None
