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

:class:`BiasedTiedProjection` adds a ``V``-sized bias (RoBERTa's LM head). The bias
stays replicated, a dense parameter all-reduced with the others: ``V`` floats a step,
``1/D`` of the table, against a second sharded table's bookkeeping (its own exchange,
optimizer state and checkpoint key) for no measurable saving. On the vocab-parallel path
each rank adds its own rows' bias to its own logits (one more column of the shard and
of the hidden states), so the bias gradient it computes is the sum over every rank's
tokens for its rows. Times ``1/N`` (in float32, before its one rounding, as the table's
rows) that is the data-parallel average of those rows; the backward all-gathers every
rank's rows (``V`` elements received, in the bias's dtype), so every rank holds the
averaged gradient of the whole bias and the dense all-reduce's average leaves it as the
gather path's full logits give it. Kept on its owner alone, the gradient would have to
be ``N`` times that (the sum over the ranks) and under fp16 would overflow at a loss
scale ``N`` times lower than stock DDP's, whose ranks hold their own tokens' sums.
"""
from __future__ import annotations


from typing import Optional, Tuple

import torch
import torch.nn as nn

from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.sharded_output import VocabParallelOutput
from embrace_fairseq.core.table_alias import TableWeightAlias
from embrace_fairseq.core.table_dist import gather_full


class TiedShardedProjection(TableWeightAlias, VocabParallelOutput, nn.Module):
    """``features @ table.T`` against a sharded table, tied to it.

    The table is *not* registered as a submodule: it is owned by the embedding. As the
    stock tied ``nn.Linear`` does, the layer holds the table's parameter as its own
    ``weight`` (:mod:`.table_alias`; ``named_weight=False``: a part of a module that
    holds it, as RoBERTa's head does), so parameter names, ties and state-dict keys
    are the stock model's.
    """

    def __init__(self, table: ShardedEmbedding, mode: str = "gather", *, named_weight: bool = True) -> None:
        super().__init__()
        object.__setattr__(self, "_table", table)
        if named_weight:
            self.alias_table_weight(table)
            self.register_parameter("bias", None)  # as the stock nn.Linear(bias=False)
        self.in_features = table.embedding_dim
        self.out_features = table.num_embeddings
        self.set_output_mode(mode)

    def output_table(self) -> ShardedEmbedding:
        return self._table

    def forward(self, features: torch.Tensor):
        return self.project(features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to a sharded table"


class _ReplicatedRows(torch.autograd.Function):
    """This rank's rows of a replicated vector (the bias), in the shard's row order; the
    backward gathers every rank's rows' gradients into the whole vector's, on every rank
    alike (collective: every rank's backward runs it). Recorded as dense gradient bytes."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, table: ShardedEmbedding) -> torch.Tensor:  # type: ignore[override]
        ctx.table = table
        return table.plan.shard_rows(full.detach(), table.rank).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        table = ctx.table
        full = gather_full(grad.reshape(-1, 1), table.plan, table.group, table.rank, table.ledger, kind=K.DENSE_GRAD)
        return full.reshape(-1), None


class BiasedTiedProjection(TiedShardedProjection):
    """``features @ table.T + bias`` against a sharded table, tied to it, with a
    replicated ``V``-sized bias (see the module's docstring for why replicated).

    Neither the table nor the bias is registered here: the embedding owns the table and
    the enclosing head the bias, so the state dict keeps the stock keys.
    """

    def __init__(self, table: ShardedEmbedding, bias: nn.Parameter, mode: str = "gather") -> None:
        if tuple(bias.shape) != (table.num_embeddings,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for a table of {table.num_embeddings} rows")
        super().__init__(table, mode, named_weight=False)
        object.__setattr__(self, "_bias", bias)

    def full_logits(self, features: torch.Tensor) -> torch.Tensor:
        return super().full_logits(features) + self._bias

    def shard_operands(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        table = self.output_table()
        # this rank's rows of the bias, in its own dtype: their gradient comes back scaled
        # (extra_grad_scale) and rounded once, and is gathered whole on every rank
        rows = _ReplicatedRows.apply(self._bias, table)
        ones = hidden.new_ones(hidden.shape[0], 1)
        return torch.cat([hidden, ones], dim=1), table.weight, rows.unsqueeze(1)

    def extra_grad_scale(self) -> float:
        # the data-parallel average of a replicated parameter's gradient, on every rank
        return 1.0 / self.output_table().world_size

    def extra_repr(self) -> str:
        return super().extra_repr() + ", with a replicated bias"
