"""Start-up check that every rank builds the same sharded table.

Each rank derives its shard plan on its own (``ShardPlan`` is pure arithmetic), so a
rank started with another dictionary, embedding size or world size would silently own
other rows and exchange garbage, or wait in a collective whose sizes never match.
:func:`check_same_plan` all-gathers a small description of the table, once, when the
table is built, and raises the same error on every rank when they differ.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .shard_plan import ShardPlan

_FIELDS = ("rows", "dim", "padding_idx", "world_size", "plan fingerprint")


class ShardPlanMismatchError(RuntimeError):
    """Ranks disagree about a sharded table (vocabulary, size, padding or world size)."""


def describe(plan: ShardPlan, embedding_dim: int, padding_idx: Optional[int]) -> Tuple[int, ...]:
    """What every rank must agree on, as integers (the fingerprint cut to 60 bits)."""
    return (
        plan.num_embeddings,
        embedding_dim,
        -1 if padding_idx is None else padding_idx,
        plan.world_size,
        int(plan.fingerprint(), 16) >> 4,
    )


def check_same_plan(
    plan: ShardPlan,
    embedding_dim: int,
    padding_idx: Optional[int],
    group: Optional["dist.ProcessGroup"] = None,
    *,
    what: str = "sharded embedding",
) -> None:
    """Collective: raise :class:`ShardPlanMismatchError` on every rank unless all agree."""
    mine = torch.tensor(describe(plan, embedding_dim, padding_idx), dtype=torch.long)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(int(x) for x in t.tolist()) for t in gathered]
    if len(set(rows)) == 1:
        return
    raise ShardPlanMismatchError(mismatch_message(rows, what))


def mismatch_message(per_rank: List[Tuple[int, ...]], what: str = "sharded embedding") -> str:
    """Name the differing fields, with the ranks holding each value."""
    parts = []
    for i, name in enumerate(_FIELDS):
        values: Dict[int, List[int]] = {}
        for rank, row in enumerate(per_rank):
            values.setdefault(row[i], []).append(rank)
        if len(values) > 1:
            shown = "; ".join(
                f"ranks {','.join(map(str, ranks))}: {_show(name, v)}" for v, ranks in values.items()
            )
            parts.append(f"{name} differs ({shown})")
    return (
        f"the ranks disagree about a {what}: " + ", ".join(parts)
        + ". Every rank must build it from the same dictionary, embedding size and world size "
        "(check the data directory, the model options and the launcher on each rank)."
    )


def _show(name: str, value: int) -> str:
    if name == "padding_idx" and value == -1:
        return "None"
    if name == "plan fingerprint":
        return f"{value:015x}"
    return str(value)
