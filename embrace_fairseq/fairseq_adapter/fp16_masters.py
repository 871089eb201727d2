"""fairseq's ``--fp16`` with sharded tables: fp32 master copies per parameter.

``--fp16`` trains through fairseq's ``FP16Optimizer``, which keeps fp32 master copies of the
parameters and steps those. By default it builds one flat fp32 tensor for all of them. For
a model with sharded tables that flat copy mixes each rank's shard rows with the replicated
parameters: the gradient norm (overflow check and clipping) could no longer add the
shards' squares across ranks, so ranks would disagree on skipping a step, and the Adam
moments could not be gathered into world-size-free checkpoints. For such a model the copies
are made per parameter instead, as ``--fp16-no-flatten-grads`` does, and each copy of a
shard carries the shard's marks (:data:`~embrace_fairseq.core.sharded_embedding.SHARDED_ATTR`
and its table), as fairseq's own per-parameter copies carry ``expert`` and
``param_group``. The update is the same element-wise arithmetic either way; only the
norm's sum runs in another order.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List

import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer, _FP16OptimizerMixin
from omegaconf import open_dict

from embrace_fairseq.core.sharded_embedding import SHARDED_ATTR, is_sharded_param

logger = logging.getLogger(__name__)

#: the attributes that make a parameter a table's shard for the norm and the optimizer state
SHARD_MARKS = (SHARDED_ATTR, "_embrace_table")

_APPLIED = False


def copy_shard_marks(params: List[torch.Tensor], copies: List[torch.Tensor]) -> None:
    """Give each fp32 copy of a shard the shard's marks (``params`` and ``copies`` in order)."""
    for p, p32 in zip(params, copies):
        for name in SHARD_MARKS:
            if hasattr(p, name):
                setattr(p32, name, getattr(p, name))


def _build_fp32_params(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_fp32_params(cls, args, params, flatten=True):
        params = list(params)
        copies = original.__get__(cls)(args, params, flatten=flatten)
        if not flatten:
            copy_shard_marks(params, copies)
        return copies

    return classmethod(build_fp32_params)


def _build_optimizer(original: Callable) -> Callable:
    @functools.wraps(original)
    def build_optimizer(cls, cfg: Any, params, **kwargs):
        params = list(params)
        if any(is_sharded_param(p) for p in params) and not getattr(cfg.common, "fp16_no_flatten_grads", False):
            with open_dict(cfg):
                cfg.common.fp16_no_flatten_grads = True
            logger.info("EmbRace --fp16: fp32 master copies per parameter (as --fp16-no-flatten-grads), so that "
                        "the tables' shards keep their own for the gradient norm and the checkpoints")
        return original.__get__(cls)(cfg, params, **kwargs)

    return classmethod(build_optimizer)


def apply() -> None:
    """Install the two wrappers once (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _FP16OptimizerMixin.build_fp32_params = _build_fp32_params(_FP16OptimizerMixin.__dict__["build_fp32_params"].__func__)
    FP16Optimizer.build_optimizer = _build_optimizer(FP16Optimizer.__dict__["build_optimizer"].__func__)
    _APPLIED = True
