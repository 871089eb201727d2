"""EmbRace for fairseq and DeepSpeed: vocab-sharded embeddings exchanged with AlltoAll.

Core (framework-agnostic): :class:`ShardPlan`, the exchange primitives in
:mod:`embrace_fairseq.exchange`, :class:`ShardedEmbedding` and byte accounting
(:class:`CommLedger`). Adapters for fairseq and DeepSpeed live in subpackages and
hold no algorithm.
"""
from .comm_ledger import CommLedger, global_ledger
from .exchange import InvalidIdError
from .shard_plan import ShardPlan
from .sharded_embedding import (
    SHARDED_ATTR,
    ShardedEmbedding,
    consolidate,
    fairseq_initial_table,
    is_sharded_param,
    sharded_embeddings,
)

__version__ = "0.1.0"

__all__ = [
    "CommLedger",
    "InvalidIdError",
    "SHARDED_ATTR",
    "ShardPlan",
    "ShardedEmbedding",
    "consolidate",
    "fairseq_initial_table",
    "global_ledger",
    "is_sharded_param",
    "sharded_embeddings",
]
