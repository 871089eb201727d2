"""A sharded table's parameter under a second name, as stock tied layers hold it.

A stock model that ties its output layer to its embedding registers the one parameter
in both modules: ``decoder.output_projection.weight`` *is* ``decoder.embed_tokens.weight``,
RoBERTa's ``encoder.lm_head.weight`` *is* ``encoder.sentence_encoder.embed_tokens.weight``.
Scripts read, freeze and re-initialise it under either name, and fairseq's and torch's
helpers list it under both (``named_parameters(remove_duplicate=False)``,
``state_dict()``). :class:`TableWeightAlias` gives a module over a
:class:`~embrace_fairseq.core.sharded_embedding.ShardedEmbedding` the same ``weight``:
the table's own parameter object (this rank's shard when the table is sharded, marked
``embrace_sharded``), so ties hold by identity and the optimizer sees it once; its
``full_weight()`` is the full table, as the table's own is.

Its state-dict entry is what the table writes under its own key (the full table after
:func:`~embrace_fairseq.core.sharded_embedding.consolidate`), so a checkpoint lists the
stock keys with the stock values. On load the table reads its rows under its own key;
this entry is consumed without a second copy, and a checkpoint without it (written
before the alias existed) loads as well.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

from embrace_fairseq.core.sharded_embedding import ShardedEmbedding

#: the name stock tied layers give the shared parameter
ALIAS = "weight"


class TableWeightAlias(nn.Module):
    """Mixin for a module whose ``weight`` is a sharded table's parameter (see the module)."""

    def alias_table_weight(self, table: ShardedEmbedding) -> None:
        """Register ``table.weight`` as this module's ``weight`` (the same object)."""
        object.__setattr__(self, "_alias_table", table)  # not a submodule: the embedding owns it
        self.register_parameter(ALIAS, table.weight)

    def full_weight(self) -> torch.Tensor:
        """The full table, as :meth:`ShardedEmbedding.full_weight` (collective when sharded)."""
        return self.__dict__["_alias_table"].full_weight()

    def _save_to_state_dict(self, destination: Dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        table = self.__dict__.get("_alias_table")
        if table is not None and table.is_sharded and self._parameters.get(ALIAS) is table.weight:
            own: Dict = {}
            table._save_to_state_dict(own, prefix, keep_vars)  # the full table, or the table's own error
            destination[prefix + ALIAS] = own[prefix + ALIAS]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # type: ignore[override]
        key = prefix + ALIAS
        state_dict.pop(key, None)  # the table loads these rows under its own key
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in missing_keys:
            missing_keys.remove(key)
