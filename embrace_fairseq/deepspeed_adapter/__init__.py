"""DeepSpeed adapter: EmbRace's hybrid communication and 2D schedule on a DeepSpeed engine.

Entry point::

    from embrace_fairseq.deepspeed_adapter import initialize
    engine, optimizer, loader, scheduler = initialize(model=model, model_parameters=model.parameters(),
                                                      config="ds_config/embrace_cpu.json")
    loss = engine(batch); engine.backward(loss); engine.step()
    engine.embrace.summary()   # bytes by kind, hidden communication share (with "trace" set)

``initialize`` takes the arguments of ``deepspeed.initialize`` and returns what it
returns. The DeepSpeed config may hold an ``"embrace"`` section (see
:class:`EmbraceConfig`); it is validated and removed before DeepSpeed sees the config.
Build the model (its ``ShardedEmbedding`` tables) after torch.distributed is initialised.
"""
from __future__ import annotations

import argparse
import copy
from typing import Any, Mapping, Optional, Union

from .config import EmbraceConfig, EmbraceConfigError, check_supported, parse_embrace_config, split_config
from .engine_hook import EmbraceEngineHook, attach, shards_kept_out_of_broadcast

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
        check_supported(ds_config)
    with shards_kept_out_of_broadcast():
        out = deepspeed.initialize(model=model, config=ds_config, args=args, **kwargs)
    engine = out[0]
    engine.embrace = attach(engine, embrace)
    from ..startup_guard import guard  # peer watchdog; the same schedule and dense weights on every rank
    guard(engine.module, engine.embrace.schedule)
    return out
