"""Hooks into fairseq's trainer so sharded tables train and checkpoint correctly.

fairseq computes some things globally that must now cover every shard, and saves
checkpoints from rank 0 only. Each hook is a thin wrapper of one fairseq function;
the algorithms live in the core modules (grad_norm, optimizer_state).

* ``utils.clip_grad_norm_``: the norm includes all ranks' shard gradients, so clipping
  and overflow checks take the same decision on every rank.
* ``Trainer.consolidate_optimizer`` (called on every rank before a save): gathers the
  full tables and the shards' optimizer state, so rank 0 writes world-size
  independent checkpoints.
* ``Trainer.state_dict``: writes those full optimizer states.
* ``FairseqOptimizer.load_state_dict``: each rank keeps its rows of full states; also
  ``--memory-efficient-fp16/bf16``'s loader, which copies the loaded moments back
  after the wrapped optimizer's load (it gets them sliced first).
* ``Trainer.consolidate_optimizer`` / ``Trainer.save_checkpoint``: the full tables and
  moments gathered for a save are dropped by the ranks that do not write at once, and
  by the writer right after writing: no rank keeps them between saves.
* ``Trainer.__init__``: rejects combinations that cannot work, at start-up, and turns
  on the overlapped full-table exchange of tied tables (``EMBRACE_TABLE_OVERLAP=0``: off)
  and the deferred table gradient of vocab-parallel output layers
  (``EMBRACE_DEFER_OUTPUT_GRAD=0``: off).
* ``FairseqOptimizer.all_reduce_grads``: first computes the deferred table gradients and
  waits for the tables' overlapped gradient reduce-scatters, before any gradient is
  reduced, scaled or clipped.
* ``LegacyDistributedDataParallel.__init__``: sizes its all-reduce buffer by the
  parameters it reduces. fairseq sizes it by *all* parameters and all-reduces the
  whole buffer; shards of uneven size (vocab not divisible by the world size) would
  then give ranks buffers of different lengths and a mismatched collective.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
from fairseq import utils as fairseq_utils
from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel
from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from fairseq.optim.fp16_optimizer import _MemoryEfficientFP16OptimizerMixin
from fairseq.trainer import Trainer

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.optim.grad_norm import combine_norms, sharded_sq_norm
from embrace_fairseq.optim.optimizer_state import gather_sharded_state, to_local_state, with_full_state
from embrace_fairseq.core.sharded_embedding import (
    consolidate,
    finish_pending,
    is_sharded_param,
    release_consolidated,
    sharded_embeddings,
)

_APPLIED = False


def _has_sharded_tables(model: torch.nn.Module) -> bool:
    return any(emb.is_sharded for emb in sharded_embeddings(model))


def _clip_grad_norm(original):
    @functools.wraps(original)
    @torch.no_grad()
    def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        sharded = [p for p in params if is_sharded_param(p)]
        if not sharded:
            return original(params, max_norm, aggregate_norm_fn)
        dense = [p for p in params if not is_sharded_param(p)]
        dense_norm = original(dense, 0.0, aggregate_norm_fn)  # max_norm 0: norm only
        shard_sq = sharded_sq_norm([p.grad for p in sharded if p.grad is not None])
        total = combine_norms(dense_norm, shard_sq)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total + 1e-6)).clamp_(max=1)
            grads = [p.grad.detach() for p in params if p.grad is not None]
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        return total

    clip_grad_norm_._embrace_wrapped = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def _consolidate_optimizer(original):
    @functools.wraps(original)
    def consolidate_optimizer(self: Trainer) -> Any:
        self._embrace_full_optim = None
        if _has_sharded_tables(self.model):
            consolidate(self.model)  # collective: every rank is here before a save
            if not self.cfg.checkpoint.no_save_optimizer_state:
                self._embrace_full_optim = gather_sharded_state(_torch_optimizer(self.optimizer))
            if not _writes(self):
                release_full_copies(self)  # gathered for rank 0's file only
        return original(self)

    return consolidate_optimizer


def _writes(trainer: Trainer) -> bool:
    return bool(getattr(trainer, "should_save_checkpoint_on_current_rank", True)) or bool(
        getattr(trainer, "always_call_state_dict_during_save_checkpoint", False))


def release_full_copies(trainer: Trainer) -> None:
    """Drop the full tables and moments gathered for a save."""
    trainer._embrace_full_optim = None
    release_consolidated(trainer.model)


def _save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(self: Trainer, filename, extra_state):
        try:
            return original(self, filename, extra_state)
        finally:
            release_full_copies(self)

    return save_checkpoint


def _mem_efficient_load_state_dict(original):
    """fairseq's ``_MemoryEfficientFP16OptimizerMixin.load_state_dict`` loads through the
    wrapped optimizer (sliced by :func:`_optimizer_load_state_dict`) and then copies the
    *given* state's moments back over it, full tables included: the first update then
    fails with a shape mismatch. Slice them before it sees them."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict, optimizer_overrides=None):
        inner = getattr(self, "wrapped_optimizer", None)
        inner = getattr(inner, "_optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            state_dict = to_local_state(state_dict, inner)
        return original(self, state_dict, optimizer_overrides)

    return load_state_dict


def _state_dict(original):
    @functools.wraps(original)
    def state_dict(self: Trainer) -> Any:
        state = original(self)
        full = getattr(self, "_embrace_full_optim", None)
        if full and "last_optimizer_state" in state:
            state["last_optimizer_state"] = with_full_state(state["last_optimizer_state"], full)
        return state

    return state_dict


def _optimizer_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self: FairseqOptimizer, state_dict, optimizer_overrides=None):
        inner = getattr(self, "_optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            state_dict = to_local_state(state_dict, inner)
        return original(self, state_dict, optimizer_overrides)

    return load_state_dict


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    # FairseqOptimizer -> torch optimizer; fp16 wrappers hold an fp32 FairseqOptimizer.
    while not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "fp32_optimizer", None) or opt.optimizer
    return opt


class UnsupportedTrainingConfig(UserError, ValueError):
    """A fairseq training flag, or a combination of them, that EmbRace cannot run."""


def validate_training_config(cfg: Any, model: torch.nn.Module) -> None:
    """Clear start-up errors for combinations that cannot work (one line each, as user
    errors are printed: :mod:`embrace_fairseq.guards.one_line_errors`)."""
    common = cfg.common
    sharded = _has_sharded_tables(model)
    if common.cpu and common.amp:
        raise UnsupportedTrainingConfig(
            "--amp needs a CUDA device (torch.cuda.amp): drop the flag, or train on GPU.")
    if common.cpu and common.fp16 and not (common.memory_efficient_fp16 or common.fp16_no_flatten_grads or sharded):
        # fairseq builds its flat fp32 copy on torch.cuda.current_device(); per-parameter
        # copies (and EmbRace models, which always take them: fp16_masters.py) run on CPU
        raise UnsupportedTrainingConfig(
            "--fp16 on CPU (--cpu) needs --fp16-no-flatten-grads: fairseq builds its flat fp32 copy "
            "of the parameters on a CUDA device.")
    if sharded:
        backend = cfg.distributed_training.ddp_backend
        if backend not in ("legacy_ddp", "no_c10d", "c10d", "pytorch_ddp"):
            raise UnsupportedTrainingConfig(
                f"--ddp-backend {backend} is not supported with EmbRace architectures; "
                "use legacy_ddp or c10d (the sharded tables do their own exchange)"
            )
        # --fp16/--bf16: fairseq's FP16Optimizer keeps fp32 master copies, made per
        # parameter with the shards' marks for these models (fp16_masters.py)


def _trainer_init(original):
    @functools.wraps(original)
    def __init__(self: Trainer, cfg, task, model, criterion, *args, **kwargs):
        validate_training_config(cfg, model)
        overlap = os.environ.get(TABLE_OVERLAP_ENV, "1") != "0"
        defer = os.environ.get(DEFER_OUTPUT_GRAD_ENV, "1") != "0"
        for emb in sharded_embeddings(model):  # collective: every rank builds its trainer here
            emb.set_table_overlap(overlap)
            # computed at all_reduce_grads' finish_pending, while the dense all-reduce is in flight
            emb.set_defer_output_grad(defer)
        return original(self, cfg, task, model, criterion, *args, **kwargs)

    return __init__


#: Environment variable: ``0`` keeps the tied tables' full-table exchange synchronous.
TABLE_OVERLAP_ENV = "EMBRACE_TABLE_OVERLAP"
#: Environment variable: ``0`` computes a vocab-parallel output layer's table gradient in
#: its backward instead of after it (see ``ShardedEmbedding.set_defer_output_grad``).
DEFER_OUTPUT_GRAD_ENV = "EMBRACE_DEFER_OUTPUT_GRAD"


def _all_reduce_grads(original):
    @functools.wraps(original)
    def all_reduce_grads(self: FairseqOptimizer, module):
        finish_pending(module)
        return original(self, module)

    return all_reduce_grads


#: Environment variable: digits fairseq's meters keep in logs (fairseq rounds to 3);
#: comparing two runs closely (e.g. EmbRace vs stock) needs more.
LOG_PRECISION_ENV = "EMBRACE_LOG_PRECISION"


def _log_precision() -> None:
    digits = os.environ.get(LOG_PRECISION_ENV)
    if not digits:
        return
    from fairseq.logging import meters

    ndigits = int(digits)
    original = meters.safe_round
    meters.safe_round = lambda number, _ndigits: original(number, max(ndigits, _ndigits))


def _legacy_ddp_init(original):
    @functools.wraps(original)
    def __init__(self: LegacyDistributedDataParallel, module, process_group, buffer_size=2**28):
        original(self, module, process_group, buffer_size)
        reduced = sum(p.numel() for p in module.parameters() if not hasattr(p, "expert"))
        self.buffer_size = max(1, min(buffer_size, reduced))

    return __init__


def apply() -> None:
    """Install the hooks once (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _log_precision()
    fairseq_utils.clip_grad_norm_ = _clip_grad_norm(fairseq_utils.clip_grad_norm_)
    Trainer.consolidate_optimizer = _consolidate_optimizer(Trainer.consolidate_optimizer)
    Trainer.state_dict = _state_dict(Trainer.state_dict)
    Trainer.save_checkpoint = _save_checkpoint(Trainer.save_checkpoint)
    _MemoryEfficientFP16OptimizerMixin.load_state_dict = _mem_efficient_load_state_dict(
        _MemoryEfficientFP16OptimizerMixin.load_state_dict)
    Trainer.__init__ = _trainer_init(Trainer.__init__)
    FairseqOptimizer.all_reduce_grads = _all_reduce_grads(FairseqOptimizer.all_reduce_grads)
    FairseqOptimizer.load_state_dict = _optimizer_load_state_dict(FairseqOptimizer.load_state_dict)
    LegacyDistributedDataParallel.__init__ = _legacy_ddp_init(LegacyDistributedDataParallel.__init__)
    _APPLIED = True
