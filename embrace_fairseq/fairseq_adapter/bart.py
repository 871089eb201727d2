"""EmbRace BART and mBART for fairseq.

``embrace_bart`` is fairseq's ``bart`` model with the EmbRace table: every stock
``bart`` architecture (``bart_base``, ``bart_large``, ``mbart_base``, ``mbart_large``,
``mbart_base_wmt20``, and any other registered for ``bart``) is registered again as
``embrace_<stock>`` with the stock presets. BART shares all embeddings: one
:class:`~embrace_fairseq.ShardedEmbedding` serves the encoder, the decoder and the tied
output projection, and a training step looks up source and target tokens with one
exchange (:meth:`EmbraceTransformerModel.forward`). The output layer takes the same
``--embrace-output`` rule as the translation models; the ``--embrace-*`` flags are
theirs (:mod:`.models`). Classification heads, ``upgrade_state_dict_named``,
``from_pretrained`` and the hub interface are BART's own.

What differs from :class:`~.models.EmbraceTransformerModel` is BART's initialisation:
``BARTModel.__init__`` re-draws every embedding and linear layer with
``init_bert_params``, whose ``isinstance`` tests do not see a sharded table or the tied
projection over it. :meth:`EmbraceBARTModel.apply` runs that initialisation with
:func:`init_bert_params_sharded`, which draws each table as the stock model draws it (the
full table, so the random stream and every module drawn after it stay the stock
model's) and keeps this rank's rows.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_INV_REGISTRY, register_model, register_model_architecture
from fairseq.models.bart import BARTModel
from fairseq.modules.transformer_sentence_encoder import init_bert_params

from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.tied_projection import TiedShardedProjection
from embrace_fairseq.fairseq_adapter.models import EmbraceTransformerModel, UnsupportedWithSharding

#: the stock model whose architectures are mirrored here
STOCK_MODEL = "bart"
PREFIX = "embrace_"


def _bert_normal_table(table: ShardedEmbedding, zero_padding: bool) -> None:
    # init_bert_params' draw for a table of this size: N(0, 0.02) on the full table, on the CPU
    full = torch.empty(table.num_embeddings, table.embedding_dim, dtype=table.weight.dtype).normal_(mean=0.0, std=0.02)
    if zero_padding and table.padding_idx is not None:
        full[table.padding_idx].zero_()
    table.load_full_weight(full)


def init_bert_params_sharded(module: nn.Module) -> None:
    """fairseq's ``init_bert_params`` for a model with sharded tables.

    A :class:`ShardedEmbedding` is drawn as the stock ``nn.Embedding`` (padding row
    zeroed), the tied projection over it as the stock ``nn.Linear`` whose weight *is* the
    table (drawn again, padding row not zeroed: the stock model's table ends that way).
    Every other module goes to the stock function.
    """
    if isinstance(module, ShardedEmbedding):
        _bert_normal_table(module, zero_padding=True)
    elif isinstance(module, TiedShardedProjection):
        _bert_normal_table(module.output_table(), zero_padding=False)
    else:
        init_bert_params(module)


@register_model("embrace_bart")
class EmbraceBARTModel(EmbraceTransformerModel, BARTModel):
    """``bart`` with one vocab-sharded table for encoder, decoder and output (``--arch embrace_bart_*``,
    ``embrace_mbart_*``)."""

    @classmethod
    def build_model(cls, args, task):
        if not getattr(args, "share_all_embeddings", True):
            raise UnsupportedWithSharding("embrace_bart architectures share all embeddings, as stock BART does")
        return super().build_model(args, task)

    def apply(self, fn: Callable[[nn.Module], None]) -> "EmbraceBARTModel":
        # BARTModel.__init__ calls self.apply(init_bert_params): draw the sharded tables as stock does
        return super().apply(init_bert_params_sharded if fn is init_bert_params else fn)


def _register_architectures() -> None:
    # Same presets as the stock architectures, under EmbRace names.
    for stock in ARCH_MODEL_INV_REGISTRY.get(STOCK_MODEL, []):
        register_model_architecture("embrace_bart", PREFIX + stock)(ARCH_CONFIG_REGISTRY[stock])


#: stock architecture -> EmbRace architecture registered here
BART_ARCHS = {stock: PREFIX + stock for stock in ARCH_MODEL_INV_REGISTRY.get(STOCK_MODEL, [])}

_register_architectures()
