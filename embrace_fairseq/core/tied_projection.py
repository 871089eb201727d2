"""Tied output projection over a sharded table.

With tied input/output embeddings the decoder's softmax layer reads the *whole*
table. Two ways to do that with a row-sharded table (docs/DESIGN.md):

* ``gather``: all-gather the table for the projection and reduce-scatter its dense
  gradient: the volume of the dense all-reduce DDP spends on it, never worse.
* ``vocab_parallel``: each rank projects everyone's hidden states onto its own rows
  and the softmax statistics are combined; it exchanges activations instead of
  weights and wins when all ranks' tokens are fewer than the vocab. It needs a loss
  that takes it (:mod:`.vocab_parallel`, :mod:`.sharded_output`): once enabled,
  :class:`TiedShardedProjection` returns a marker in training and the loss picks the
  path per step.
"""
from __future__ import annotations


import torch
import torch.nn as nn

from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.sharded_output import VocabParallelOutput


class TiedShardedProjection(VocabParallelOutput, nn.Module):
    """``features @ table.T`` against a sharded table, tied to it.

    The table is *not* registered as a submodule: it is owned by the embedding, and
    the state dict stays that of the stock model (fairseq re-creates
    ``output_projection.weight`` from ``embed_tokens.weight`` when it is missing).
    """

    def __init__(self, table: ShardedEmbedding, mode: str = "gather") -> None:
        super().__init__()
        object.__setattr__(self, "_table", table)
        self.in_features = table.embedding_dim
        self.out_features = table.num_embeddings
        self.set_output_mode(mode)

    def output_table(self) -> ShardedEmbedding:
        return self._table

    def forward(self, features: torch.Tensor):
        return self.project(features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        # A stock checkpoint carries the tied weight under this name as well; the
        # embedding loads it, so it is consumed here without a copy.
        state_dict.pop(prefix + "weight", None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to a sharded table"
