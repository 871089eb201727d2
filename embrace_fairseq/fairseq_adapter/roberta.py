"""EmbRace RoBERTa / XLM-R for fairseq (``--arch embrace_roberta*``, ``embrace_xlm``).

Each architecture is the stock ``roberta`` one (same presets, flags and modules) with
its token table a :class:`~embrace_fairseq.ShardedEmbedding` and, when tied (the
default), the masked-LM head's output layer a
:class:`~embrace_fairseq.core.tied_projection.BiasedTiedProjection` over that table:
in training with ``masked_lm`` it runs vocab-parallel over the masked positions only
when that moves fewer bytes than gathering the table (``--embrace-output``; the choice
is :class:`~embrace_fairseq.core.vocab_parallel.OutputChooser`'s, as for the
translation models). The head's ``V``-sized bias stays replicated (why: the
projection's docstring). ``--untie-weights-roberta`` keeps the stock head (its own
replicated ``V x D`` weight); the token table is sharded either way.

The model is built as the stock one is, then its table and head are swapped for the
EmbRace ones holding the same values: the random stream, and so every weight, is the
stock model's. Parameter names, ties and state-dict keys are the stock model's: the
tied head's ``encoder.lm_head.weight`` is the token table's parameter under a second
name (:mod:`~embrace_fairseq.core.table_alias`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models.roberta.model import RobertaLMHead, RobertaModel
from fairseq.utils import safe_getattr

from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.table_alias import TableWeightAlias
from embrace_fairseq.core.tied_projection import BiasedTiedProjection
from embrace_fairseq.fairseq_adapter import table_plan as TP
from embrace_fairseq.fairseq_adapter.models import (
    EmbraceTransformerLanguageModelConfig,
    PlanFreeState,
    build_sharded_embedding,
    check_supported,
    mark_for_fairseq,
    output_mode,
    stock_class,
    table_options_of,
)
from embrace_fairseq.planner.cost import REPLICATE

logger = logging.getLogger(__name__)

#: stock architecture -> EmbRace architecture registered here
ROBERTA_ARCHS = {stock: "embrace_" + stock for stock in ("roberta", "roberta_prenorm", "roberta_base",
                                                         "roberta_large", "xlm")}

# The --embrace-* options, as the EmbRace language model declares them (one definition).
EmbraceFlags = dataclasses.make_dataclass(
    "EmbraceFlags",
    [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
     for f in dataclasses.fields(EmbraceTransformerLanguageModelConfig) if f.name.startswith("embrace_")],
    bases=(FairseqDataclass,),
)
EmbraceFlags.__module__ = __name__


class EmbraceRobertaLMHead(TableWeightAlias):
    """RoBERTa's masked-LM head (dense, activation, layer norm) whose output layer reads
    the sharded token table. Holds the stock head's own modules and bias, and as its
    ``weight`` the table's parameter (the stock head's is the table's too), so
    parameters come in the stock order under the stock names."""

    def __init__(self, stock: RobertaLMHead, table: ShardedEmbedding, mode: str) -> None:
        super().__init__()
        self.alias_table_weight(table)  # weight, then bias: the stock head's parameter order
        self.bias = stock.bias
        self.dense = stock.dense
        self.activation_fn = stock.activation_fn
        self.layer_norm = stock.layer_norm
        self.output = BiasedTiedProjection(table, self.bias, mode=mode)

    def forward(self, features: torch.Tensor, masked_tokens: Any = None, **kwargs: Any):
        if masked_tokens is not None:
            features = features[masked_tokens, :]  # as stock: only the masked positions
        x = self.layer_norm(self.activation_fn(self.dense(features)))
        return self.output(x)  # logits, or in vocab-parallel training the loss's marker


def shard_roberta(model: RobertaModel, args: Any) -> None:
    """Swap the stock model's token table (and tied head) for the EmbRace ones, same values."""
    encoder = model.encoder
    stock_table = encoder.sentence_encoder.embed_tokens
    with torch.random.fork_rng(devices=[]):  # the stock model drew its table already
        table = build_sharded_embedding(encoder.dictionary, stock_table.embedding_dim, table_options_of(args))
    table.load_full_weight(stock_table.weight.detach())
    encoder.sentence_encoder.embed_tokens = table
    if safe_getattr(args, "untie_weights_roberta", False):
        logger.info("EmbRace RoBERTa: --untie-weights-roberta keeps the stock LM head (its weight replicated)")
        return
    encoder.lm_head = EmbraceRobertaLMHead(encoder.lm_head, table, output_mode(args))


@register_model("embrace_roberta")
class EmbraceRobertaModel(PlanFreeState, RobertaModel):
    """``roberta`` with a vocab-sharded token table (``--arch embrace_roberta*``, ``embrace_xlm``)."""

    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        gen_parser_from_dataclass(parser, EmbraceFlags())

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", bpe="gpt2",
                        **kwargs):
        """``RobertaModel.from_pretrained`` (same arguments, same hub interface) that builds a
        stock ``roberta*`` checkpoint as its EmbRace architecture; EmbRace checkpoints load
        as they are. fairseq builds the class its saved configuration names, and an
        ``arch=`` override cannot change that name (``_name`` is every group's key)."""
        with _stock_loads_as_embrace():
            return super().from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, bpe, **kwargs)

    @classmethod
    def build_model(cls, args, task):
        check_supported(args, lm=False)
        plan = TP.decide(args, task, stock_class(cls), TP.roberta_tables(args, task), TP.MASKED_LM)
        model = super().build_model(args, task)
        if TP.choice(plan, TP.ROBERTA_TABLE) != REPLICATE:  # replicated: the stock table and head
            shard_roberta(model, args)
        mark_for_fairseq(model, args, plan)
        return model


def _as_embrace(model_cfg: Any) -> None:
    """Rename a stock ``roberta*`` model configuration to its EmbRace architecture."""
    from omegaconf import DictConfig, open_dict

    name = getattr(model_cfg, "_name", None)
    if name not in ROBERTA_ARCHS:
        return
    arch = getattr(model_cfg, "arch", None) or name
    if isinstance(model_cfg, DictConfig):
        with open_dict(model_cfg):
            model_cfg._name, model_cfg.arch = ROBERTA_ARCHS[name], ROBERTA_ARCHS.get(arch, arch)
    else:
        model_cfg._name, model_cfg.arch = ROBERTA_ARCHS[name], ROBERTA_ARCHS.get(arch, arch)


@contextlib.contextmanager
def _stock_loads_as_embrace() -> Iterator[None]:
    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_checkpoint_to_cpu

    def load_as_embrace(*args: Any, **kwargs: Any) -> Any:
        state = load(*args, **kwargs)
        if state.get("cfg") is not None:
            _as_embrace(state["cfg"]["model"])
        elif state.get("args") is not None:
            _as_embrace(state["args"])
        return state

    checkpoint_utils.load_checkpoint_to_cpu = load_as_embrace
    try:
        yield
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = load


def _register_architectures() -> None:
    for stock, ours in ROBERTA_ARCHS.items():
        register_model_architecture("embrace_roberta", ours)(ARCH_CONFIG_REGISTRY[stock])


_register_architectures()
