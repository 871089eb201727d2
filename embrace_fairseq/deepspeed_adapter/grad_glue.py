"""The gradient side of the DeepSpeed hook: checks of the engine, ZeRO's global norm
extended by the shards, clipping over all ranks. Each function takes the hook (or the
engine) it works for."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from embrace_fairseq.core.sharded_embedding import is_sharded_param, sharded_embeddings
from embrace_fairseq.deepspeed_adapter.config import SUPPORTED_ZERO_STAGES, EmbraceConfigError, zero_stage_refusal
from embrace_fairseq.optim.grad_norm import (combine_norms, local_nonfinite, nonfinite_and_norm, raise_if_nonfinite,
                                             sharded_sq_norm)


def check_engine(engine: Any) -> None:
    """Refuse engines the hook cannot take over (pipeline, ZeRO 3, bf16 without ZeRO,
    tables over another world)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise EmbraceConfigError("pipeline parallel engines reduce gradients themselves; EmbRace supports plain data parallelism")
    if engine.zero_optimization_stage() not in SUPPORTED_ZERO_STAGES:
        raise EmbraceConfigError(zero_stage_refusal(int(engine.zero_optimization_stage())))
    if engine.bfloat16_enabled() and engine.zero_optimization_stage() == 0:
        raise EmbraceConfigError("bf16 needs ZeRO stage 1 with the EmbRace hook (see config.check_supported)")
    world = engine.dp_world_size
    for emb in sharded_embeddings(engine.module):
        if emb.world_size != world:
            raise EmbraceConfigError(
                f"a ShardedEmbedding spans {emb.world_size} ranks but the data-parallel world is {world}: "
                "build the model after torch.distributed is initialised, over the default group"
            )


def extend_zero_norm(hook: Any) -> None:
    """ZeRO's global norm and its overflow check cover the shards too; remember its
    clip/unscale factor."""
    zopt = hook.engine.optimizer
    norm, unscale = zopt.scaled_global_norm, zopt.unscale_and_clip_grads
    tables = hook.tables
    extend_zero_overflow(zopt, tables)

    def scaled_global_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        dense = norm(*args, **kwargs)
        shard_sq = sharded_sq_norm([emb.weight.grad for emb in tables if emb.weight.grad is not None])
        if not torch.is_tensor(dense):
            dense = torch.tensor(float(dense))
        total = combine_norms(dense, shard_sq.to(dense.device)).to(dense.device)
        # DeepSpeed marks an invalid (inf/NaN) norm with -1: kept when the dense norm has
        # it, else set where the total is not finite (device-side: no host sync)
        minus_one = torch.full_like(total, -1.0)
        return torch.where(dense.float() < 0, minus_one, torch.where(torch.isfinite(total), total, minus_one))

    def unscale_and_clip_grads(grad_groups_flat: Any, total_norm: Any) -> Any:
        combined = float(zopt.loss_scale)
        if zopt.clip_grad > 0.0:
            # kept host sync (with clipping only): the shard optimizer takes its scale as a float
            clip = ((float(total_norm) / combined) + 1e-6) / zopt.clip_grad
            combined = max(clip, 1.0) * combined
        hook._last_clip_scale = 1.0 / combined
        return unscale(grad_groups_flat, total_norm)

    zopt.scaled_global_norm = scaled_global_norm
    zopt.unscale_and_clip_grads = unscale_and_clip_grads


def extend_zero_overflow(zopt: Any, tables: Any) -> None:
    """ZeRO's overflow check (``check_overflow``: its skip-step decision under fp16) sees
    the shards' gradients too. With ``zero_optimization.compute_grad_norm=false`` the
    check is the only overflow decision (no norm is taken), and it looks at the dense
    partitions alone: a non-finite shard gradient would reach the shard optimizer while
    DeepSpeed stepped the dense weights. The local flag gains the shards' flag before
    DeepSpeed all-reduces it (MAX) over the data-parallel group, so every rank skips the
    same steps, and the hook steps the shards only when DeepSpeed applied its step
    (``engine._step_applied``). With optimizer offload DeepSpeed reads another flag, but
    it refuses ``compute_grad_norm=false`` there and the extended norm decides."""
    local = getattr(zopt, "has_overflow_partitioned_grads_serial", None)
    if local is None:
        return

    def has_overflow_partitioned_grads_serial() -> torch.Tensor:
        dense = local()
        shards = local_nonfinite([emb.weight.grad for emb in tables])
        return dense | shards.to(dense.device)

    zopt.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial


@torch.no_grad()
def global_grad_norm(engine: Any) -> torch.Tensor:
    """The L2 norm of every gradient: the dense ones and all ranks' shards. Collective."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    dense = [p.grad.detach() for p in params if not is_sharded_param(p)]
    sharded = [p.grad.detach() for p in params if is_sharded_param(p)]
    dense_sq = sum((torch.linalg.vector_norm(g, 2, dtype=torch.float32) ** 2 for g in dense), torch.zeros(()))
    return combine_norms(dense_sq.sqrt(), sharded_sq_norm(sharded))


@torch.no_grad()
def checked_global_grad_norm(engine: Any, names: Dict[int, str]) -> torch.Tensor:
    """The hook's gradient check and :func:`global_grad_norm` in one pass and one
    all-reduce: stops every rank on a non-finite gradient anywhere (naming it by
    ``names``, ids to parameter names), else the norm. Collective."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    bad, norm = nonfinite_and_norm([(names.get(id(p), "?"), p.grad) for p in params],
                                   [is_sharded_param(p) for p in params])
    raise_if_nonfinite(bad)
    return norm


@torch.no_grad()
def clip_gradients(engine: Any, total: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DeepSpeed's clipping formula, with the norm taken over all ranks' shards
    (``total``: that norm when already taken for these gradients)."""
    params = [p for p in engine.module.parameters() if p.grad is not None]
    if total is None:
        total = global_grad_norm(engine)
    coef = torch.clamp(float(engine.gradient_clipping()) / (total + 1e-6), max=1.0)
    if params:
        torch._foreach_mul_([p.grad.detach() for p in params], coef.to(params[0].grad.device))
    return total
