"""EmbRace for fairseq and DeepSpeed: vocab-sharded embeddings exchanged with AlltoAll.

Core (framework-agnostic): :class:`ShardPlan`, the exchange primitives in
:mod:`embrace_fairseq.core.exchange`, :class:`ShardedEmbedding` and byte accounting
(:class:`CommLedger`). Adapters for fairseq and DeepSpeed live in subpackages and
hold no algorithm.
"""
from embrace_fairseq.core.ledger import CommLedger, global_ledger
from embrace_fairseq.core.ids import InvalidIdError
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.sharded_embedding import (
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
