"""What the schedule takes from a model: its replicated parameters, as tensor specs.

Framework-agnostic: any ``nn.Module`` whose vocab-sharded tables are
:class:`~embrace_fairseq.core.sharded_embedding.ShardedEmbedding` (their shards are
exchanged by the tables themselves, never all-reduced). Both training engines build
the plan and the executor from these two lists, so they agree on every rank.
"""
from __future__ import annotations

from typing import List

import torch

from embrace_fairseq.core.sharded_embedding import is_sharded_param
from embrace_fairseq.schedule.plan import TensorSpec


def dense_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Replicated trainable parameters, in registration order (tied ones once)."""
    return [p for p in module.parameters() if p.requires_grad and p.numel() > 0 and not is_sharded_param(p)]


def tensor_specs(module: torch.nn.Module) -> List[TensorSpec]:
    """Schedule inputs: registration order stands for the distance from the input."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        TensorSpec(names.get(id(p), f"param{i}"), p.numel(), p.element_size(), i)
        for i, p in enumerate(dense_parameters(module))
    ]
