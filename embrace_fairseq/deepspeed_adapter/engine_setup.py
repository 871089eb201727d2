"""How a DeepSpeed engine is built around sharded tables: what it broadcasts, which
parameters its optimizer holds, and the static schedule's inputs."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import torch

from embrace_fairseq.core.sharded_embedding import is_sharded_param
from embrace_fairseq.deepspeed_adapter.config import EmbraceConfig
from embrace_fairseq.schedule.model_inputs import dense_parameters, tensor_specs  # noqa: F401  (re-exported)


@contextlib.contextmanager
def shards_kept_out_of_broadcast() -> Iterator[None]:
    """While active, ``DeepSpeedEngine._broadcast_model`` skips table shards.

    DeepSpeed's own check skips parameters carrying ``ds_optim_param`` (per-rank
    weights of OptimizedLinear); shards get that mark only for the broadcast.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model

    def _broadcast_model(self) -> None:
        marked = [p for p in self.module.parameters() if is_sharded_param(p) and not hasattr(p, "ds_optim_param")]
        for p in marked:
            p.ds_optim_param = True
        try:
            original(self)
        finally:
            for p in marked:
                del p.ds_optim_param

    DeepSpeedEngine._broadcast_model = _broadcast_model
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original


def uses_shard_optimizer(zero_stage: int, config: EmbraceConfig) -> bool:
    """Whether table shards are stepped outside DeepSpeed's optimizer."""
    return zero_stage >= 1 or config.relaxed_embedding


def without_shards(params: Any) -> List[Any]:
    """``model_parameters`` for DeepSpeed without table shards (tensors or param-group dicts)."""
    out: List[Any] = []
    for item in params:
        if isinstance(item, dict):
            group = dict(item)
            group["params"] = [p for p in item["params"] if not is_sharded_param(p)]
            if group["params"]:
                out.append(group)
        elif not is_sharded_param(item):
            out.append(item)
    return out


def strip_shards_from_optimizer(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """Remove table shards from a client optimizer's param groups (and their state).
    Returns {id(shard): index of the group it was in}, so the shards get that group's
    hyper-parameters."""
    where: Dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        keep = []
        for p in group["params"]:
            if is_sharded_param(p):
                where[id(p)] = gi
                optimizer.state.pop(p, None)
            else:
                keep.append(p)
        group["params"] = keep
    return where


