"""What a training engine runs once on every rank when it starts: the peer watchdog and
the checks that all ranks built the same job (schedule, replicated weights)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.guards import watchdog
from embrace_fairseq.core.agreement import check_agreement, digest60
from embrace_fairseq.guards.replica_check import check_replicas_agree
from embrace_fairseq.core.sharded_embedding import is_sharded_param


def schedule_signature(schedule: Any) -> str:
    """The collectives in issue order: what every rank must issue identically."""
    return repr([(p.bucket, p.start, p.numel) for p in schedule.issue_order])


def guard(module: torch.nn.Module, schedule: Optional[Any] = None) -> None:
    """Install the watchdog, then (collective) check that every rank has the same dense
    parameters, the same collective schedule and the same initial replicated weights.
    Raises ``ConfigMismatchError`` / ``ReplicaDivergenceError`` on every rank otherwise."""
    watchdog.install()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    dense = [p for p in module.parameters() if not is_sharded_param(p)]
    fields = {"dense parameters": len(dense), "dense elements": sum(p.numel() for p in dense)}
    if schedule is not None:
        fields["collective schedule"] = digest60(schedule_signature(schedule))
    check_agreement(
        fields, "the model and its communication schedule",
        "Start every rank with the same model options and the same configuration file "
        "(its \"embrace\" section sets the schedule).",
        shown={"collective schedule": "hex"},
    )
    check_replicas_agree(module)
