"""EmbRace for fairseq and DeepSpeed: vocab-sharded embeddings exchanged with AlltoAll.

The public API, from the core layer (framework-agnostic): :class:`ShardPlan`,
:class:`ShardedEmbedding` and byte accounting (:class:`CommLedger`); the exchange is in
:mod:`embrace_fairseq.core.input_dist` / :mod:`~embrace_fairseq.core.output_dist` /
:mod:`~embrace_fairseq.core.table_dist`. Adapters for fairseq and DeepSpeed live in
subpackages and hold no algorithm. The layers: docs/ARCHITECTURE.md.
"""
from embrace_fairseq.core.ledger import CommLedger, global_ledger
from embrace_fairseq.core.ids import InvalidIdError
from embrace_fairseq.core.initial_table import fairseq_initial_table
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.sharded_embedding import (
    SHARDED_ATTR,
    ShardedEmbedding,
    consolidate,
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
