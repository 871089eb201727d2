"""ZeRO stage 2: where the dense gradients are when the step runs, and the step's
non-finite check over them and the table shards.

At stage 2 DeepSpeed's gradient hooks reduce-scatter each dense gradient during backward
and free ``.grad``: at the step a rank holds only its partition of the averaged dense
gradients (``averaged_gradients``), laid out as DeepSpeed's flat partition. The table
shards never enter DeepSpeed (not its optimizer, not its hooks); their gradients are in
``.grad``, complete after the embedding AlltoAll. The check therefore reads each rank's
partition pieces and its shards, and reduces the flags over the ranks, so every rank
stops at the same step naming the parameter and the rank that holds the non-finite
value (for a dense gradient: the rank whose partition holds it, after averaging).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import is_sharded_param
from embrace_fairseq.optim.grad_norm import nonfinite_gradients, raise_if_nonfinite


def _flat_partition(group: Any) -> Optional[torch.Tensor]:
    """One param group's averaged gradient partition as one flat tensor (None before the
    accumulation boundary). DeepSpeed keeps it either as one flat buffer with views
    (fp32 accumulation of low-precision gradients) or as a list of pieces and pads."""
    if group is None:
        return None
    flat = getattr(group, "flat_partition", None)
    if flat is not None:
        return flat.view(-1)
    pieces = [t.reshape(-1) for t in group]
    return torch.cat(pieces) if pieces else None


def partitioned_dense_grads(zopt: Any) -> Dict[int, torch.Tensor]:
    """{id(parameter): this rank's piece of its averaged gradient} for the dense
    parameters whose gradient partition lies (wholly or partly) on this rank, read at
    DeepSpeed's offsets (``grad_partition_insertion_offset``, ``grad_start_offset``)."""
    out: Dict[int, torch.Tensor] = {}
    averaged = getattr(zopt, "averaged_gradients", None) or {}
    for i, params in enumerate(zopt.params_in_partition):
        flat = _flat_partition(averaged.get(i))
        if flat is None:
            continue
        pid = _partition_id(zopt, i)
        size = int(zopt.partition_size[i])
        for p in params:
            pid_of = zopt.get_param_id(p)
            dest = int(zopt.grad_partition_insertion_offset[i][pid][pid_of])
            src = int(zopt.grad_start_offset[i][pid][pid_of])
            n = min(p.numel() - src, size - dest)
            if n > 0:
                out[id(p)] = flat.narrow(0, dest, n)
    return out


def _partition_id(zopt: Any, group_index: int) -> int:
    return collectives.rank(zopt.real_dp_process_group[group_index])


def named_step_gradients(module: torch.nn.Module, zopt: Any) -> List[Tuple[str, Optional[torch.Tensor]]]:
    """Every trainable parameter by name (the same list on every rank) with what this
    rank holds of its gradient at a stage-2 step: its partition piece for a dense
    parameter (None when the piece is on another rank), ``.grad`` for a table shard."""
    pieces = partitioned_dense_grads(zopt)
    named: List[Tuple[str, Optional[torch.Tensor]]] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        named.append((name, p.grad if is_sharded_param(p) else pieces.get(id(p))))
    return named


def check_before_step(engine: Any) -> None:
    """Make the ZeRO-2 optimizer's ``step`` first stop every rank on a non-finite dense
    (partitioned) or shard gradient, before any weight changes. Not with fp16, where
    DeepSpeed's overflow check skips the step on every rank instead (its global norm
    and overflow flag cover the shards: ``grad_glue.extend_zero_norm``). Wrapping the
    optimizer's step covers both DeepSpeed's managed accumulation and
    ``managed_gradient_accumulation=false``, where the partition is finished inside
    ``engine.step()``."""
    if engine.fp16_enabled():
        return
    zopt, module = engine.optimizer, engine.module
    step = zopt.step

    def checked_step(*args: Any, **kwargs: Any) -> Any:
        # collective: DeepSpeed's optimizer step runs at every boundary on every rank
        raise_if_nonfinite(nonfinite_gradients(named_step_gradients(module, zopt)))
        return step(*args, **kwargs)

    zopt.step = checked_step
