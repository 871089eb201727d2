"""Row (vocab) sharding of an embedding table over the ranks of a process group.

The plan is pure arithmetic: it never talks to other ranks. Every rank builds the
same plan from ``(num_embeddings, world_size)``, which is what lets each rank know,
without asking, who owns any id.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import List, Tuple

import torch


@dataclass(frozen=True)
class ShardPlan:
    """Contiguous vocab ranges whose sizes differ by at most one row.

    The first ``num_embeddings % world_size`` ranks hold one extra row, so any vocab
    size works with any world size (a rank may even hold zero rows when the vocab is
    smaller than the world).
    """

    num_embeddings: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_embeddings < 0:
            raise ValueError(f"num_embeddings must be >= 0, got {self.num_embeddings}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    @functools.cached_property
    def boundaries(self) -> List[int]:
        """``world_size + 1`` row offsets: rank ``r`` owns ``[b[r], b[r+1])``."""
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
        self._check_rank(rank)
        b = self.boundaries
        return b[rank], b[rank + 1]

    def shard_size(self, rank: int) -> int:
        start, end = self.shard_range(rank)
        return end - start

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank that owns each id (ids must already be in ``[0, num_embeddings)``)."""
        base, extra = divmod(self.num_embeddings, self.world_size)
        # The first `extra` ranks hold base+1 rows; the rest hold `base` rows.
        split = extra * (base + 1)
        ids = ids.long()
        big = torch.div(ids, base + 1, rounding_mode="floor")
        if base == 0:
            return big
        small = extra + torch.div(ids - split, base, rounding_mode="floor")
        return torch.where(ids < split, big, small)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each id inside its owner's shard."""
        starts = torch.tensor(self.boundaries[:-1], dtype=torch.long, device=ids.device)
        return ids.long() - starts[self.owner(ids)]

    def fingerprint(self) -> str:
        """Short digest ranks compare at start-up to catch mismatched plans."""
        text = f"rows={self.num_embeddings};world={self.world_size};ranges={self.boundaries}"
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
