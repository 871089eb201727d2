"""DeepSpeed adapter: EmbRace's hybrid communication and 2D schedule on a DeepSpeed engine.

Entry point::

    from embrace_fairseq.deepspeed_adapter import initialize
    engine, optimizer, loader, scheduler = initialize(model=model, model_parameters=model.parameters(),
                                                      config="ds_config/embrace_cpu.json")
    loss = engine(batch); engine.backward(loss); engine.step()
    engine.embrace.summary()   # bytes by kind, hidden communication share (with "trace" set)

Under ZeRO stages 1 and 2 (or ``"relaxed_embedding": true``) the table shards are kept out of
DeepSpeed's optimizer (``model_parameters`` is filtered; a client optimizer instance has
them removed from its param groups) and stepped by ``engine.embrace.shard_optimizer``
with the same rule and the live hyper-parameters of DeepSpeed's optimizer.

``initialize`` takes the arguments of ``deepspeed.initialize`` and returns what it
returns. The DeepSpeed config may hold an ``"embrace"`` section (see
:class:`EmbraceConfig`); it is validated and removed before DeepSpeed sees the config.
Build the model (its ``ShardedEmbedding`` tables) after torch.distributed is initialised.
"""
from __future__ import annotations

import argparse
import copy

import torch
from typing import Any, Mapping, Optional, Union

from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce
from embrace_fairseq.deepspeed_adapter.config import (
    EmbraceConfig,
    EmbraceConfigError,
    check_supported,
    parse_embrace_config,
    split_config,
)
from embrace_fairseq.deepspeed_adapter.engine_hook import (
    EmbraceEngineHook,
    attach,
    shards_kept_out_of_broadcast,
    strip_shards_from_optimizer,
    uses_shard_optimizer,
    without_shards,
)

__all__ = [
    "EmbraceConfig",
    "EmbraceConfigError",
    "EmbraceEngineHook",
    "attach",
    "initialize",
    "parse_embrace_config",
    "shards_kept_out_of_broadcast",
    "split_config",
]


def initialize(
    *,
    model: Any,
    config: Union[None, str, Mapping[str, Any]] = None,
    args: Optional[argparse.Namespace] = None,
    **kwargs: Any,
) -> Any:
    """``deepspeed.initialize`` with the EmbRace hook attached as ``engine.embrace``.

    ``config`` (a dict or a JSON path) or ``args.deepspeed_config`` as DeepSpeed reads
    them. Raises :class:`EmbraceConfigError` before any engine is built when the
    ``"embrace"`` section or its combination with the DeepSpeed config is invalid.
    """
    import deepspeed

    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # DeepSpeed refuses a config given twice
    ds_config, embrace = split_config(config)
    if ds_config is not None:
        check_supported(ds_config, embrace)
    shard_groups = None
    stage = int(((ds_config or {}).get("zero_optimization") or {}).get("stage", 0))
    if uses_shard_optimizer(stage, embrace):
        # DeepSpeed's optimizer gets the dense parameters only; the hook steps the shards
        params = kwargs.get("model_parameters")
        kwargs["model_parameters"] = without_shards(model.parameters() if params is None else params)
        client = kwargs.get("optimizer")
        if isinstance(client, torch.optim.Optimizer):
            shard_groups = strip_shards_from_optimizer(client)
    skip_shm_allreduce()  # before DeepSpeed's comm layer starts (see cpu_comm)
    with shards_kept_out_of_broadcast():
        out = deepspeed.initialize(model=model, config=ds_config, args=args, **kwargs)
    engine = out[0]
    # attach starts the peer watchdog and checks that every rank has the same schedule and
    # dense weights before its first collective
    engine.embrace = attach(engine, embrace, shard_groups)
    return out
