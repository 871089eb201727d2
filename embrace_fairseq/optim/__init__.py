"""Optim: stepping shards the way the replicated optimizer steps whole tables.

:mod:`.shard_optimizer` (element-wise rules applied to chosen rows of a shard),
:mod:`.optimizer_state` (optimizer state between shards and full tables, for
world-size-free checkpoints), :mod:`.grad_norm` (a global norm over shards and dense
parameters, and the non-finite check every rank agrees on). Uses only :mod:`..core`.
"""
