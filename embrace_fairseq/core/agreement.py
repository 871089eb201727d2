"""Start-up checks that every rank built the same job: tables, schedule, replicas.

Each rank derives its shard plan and its communication schedule on its own (both are
pure functions of what the rank was given), so a rank started with another dictionary,
embedding size, world size or configuration would silently own other rows, or issue
its collectives in another order and hang or exchange garbage. The checks here
all-gather a few integers describing what must be equal, once, at start-up, and raise
the same error on every rank when they differ, naming the ranks and the values.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives
from embrace_fairseq.core.shard_plan import LAYOUTS, ShardPlan
from embrace_fairseq.core.errors import UserError


class ShardPlanMismatchError(UserError, RuntimeError):
    """Ranks disagree about a sharded table (vocabulary, size, padding, world size or layout)."""


class ConfigMismatchError(UserError, RuntimeError):
    """Ranks disagree about the communication schedule or the replicated model."""


def digest60(text: str) -> int:
    """A 60-bit integer digest of ``text`` (fits an int64 tensor)."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:15], 16)


def gather_values(values: Sequence[int], group: Optional["dist.ProcessGroup"] = None) -> List[Tuple[int, ...]]:
    """Every rank's ``values`` (collective; on the device the group needs)."""
    mine = torch.tensor(list(values), dtype=torch.long)
    gathered = collectives.all_gather(mine, group)
    return [tuple(int(x) for x in t.tolist()) for t in gathered]


def check_agreement(
    fields: Dict[str, int],
    what: str,
    advice: str,
    error: type = ConfigMismatchError,
    group: Optional["dist.ProcessGroup"] = None,
    shown: Optional[Dict[str, str]] = None,
) -> None:
    """Collective: raise ``error`` on every rank unless all ranks hold the same ``fields``.

    ``shown`` maps a field to how to print it: ``"hex"`` for digests.
    """
    names = list(fields)
    rows = gather_values([fields[n] for n in names], group)
    if len(set(rows)) == 1:
        return
    raise error(mismatch_message(names, rows, what, advice, shown or {}))


def mismatch_message(names: List[str], per_rank: List[Tuple[int, ...]], what: str, advice: str,
                     shown: Dict[str, str]) -> str:
    """Name the differing fields, with the ranks holding each value."""
    parts = []
    for i, name in enumerate(names):
        values: Dict[int, List[int]] = {}
        for rank, row in enumerate(per_rank):
            values.setdefault(row[i], []).append(rank)
        if len(values) > 1:
            text = "; ".join(
                f"ranks {','.join(map(str, ranks))}: {_show(shown.get(name), v)}" for v, ranks in values.items()
            )
            parts.append(f"{name} differs ({text})")
    return f"the ranks disagree about {what}: " + ", ".join(parts) + f". {advice}"


def _show(style: Optional[str], value: int) -> str:
    if style == "hex":
        return f"{value:015x}"
    if style == "optional" and value == -1:
        return "None"
    if style == "layout" and 0 <= value < len(LAYOUTS):
        return LAYOUTS[value]
    return str(value)


def check_same_plan(
    plan: ShardPlan,
    embedding_dim: int,
    padding_idx: Optional[int],
    group: Optional["dist.ProcessGroup"] = None,
) -> None:
    """Collective: raise :class:`ShardPlanMismatchError` on every rank unless all agree."""
    check_agreement(
        {
            "rows": plan.num_embeddings,
            "dim": embedding_dim,
            "padding_idx": -1 if padding_idx is None else padding_idx,
            "world_size": plan.world_size,
            "layout": LAYOUTS.index(plan.layout),
            "plan fingerprint": int(plan.fingerprint()[:15], 16),
        },
        "a sharded embedding table",
        "Every rank must build it from the same dictionary, embedding size, world size and shard layout "
        "(check the data directory, the model options (--embrace-shard-layout, the DeepSpeed "
        "\"embrace.shard_layout\") and the launcher on each rank).",
        error=ShardPlanMismatchError,
        group=group,
        shown={"padding_idx": "optional", "layout": "layout", "plan fingerprint": "hex"},
    )
