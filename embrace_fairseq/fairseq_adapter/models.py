"""EmbRace Transformer and Transformer LM for fairseq.

Each architecture is the stock one with its token embeddings replaced by
:class:`~embrace_fairseq.ShardedEmbedding` (vocab-sharded over the data-parallel
ranks) and, when input and output embeddings are tied, the output projection
reading the sharded table through :class:`~embrace_fairseq.core.tied_projection.TiedShardedProjection`.
Untied output projections are sharded the same way (:class:`~embrace_fairseq.core.sharded_output.ShardedOutputProjection`)
unless ``--embrace-output gather``; ``--embrace-output`` picks how the output layer reads
its table in training (see :mod:`.vocab_parallel_criteria`).
Everything else (layers, flags, hyper-parameters, architecture presets) is fairseq's,
plus ``--embrace-shard-layout {strided,contiguous}``: which rank owns which row
(default ``strided``: balanced exchanges; checkpoints are in vocabulary order with
either, so they load under any layout and world size), and ``--embrace-exchange
{auto,flat,node}`` with ``--embrace-ranks-per-node``: the route of lookups on a job of
several nodes (see :mod:`~embrace_fairseq.core.node_exchange`).

``--embrace-plan`` decides which tables are sharded at all (:mod:`.table_plan`): a table
the plan replicates is built as the stock architecture builds it (a plain embedding, the
stock tied or untied output layer) and fairseq's data-parallel wrapper all-reduces it.
The state dict has the same keys under every plan (:func:`fill_tied_keys`), so a
checkpoint saved under one plan loads under another.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Iterator, List, Optional

import torch.nn as nn
from fairseq.dataclass import ChoiceEnum
from fairseq.models import ARCH_CONFIG_REGISTRY, register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerDecoderBase, TransformerModel
from fairseq.models.transformer.transformer_decoder import TransformerDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from fairseq.utils import safe_getattr
from omegaconf import II

from embrace_fairseq.core.sharded_output import ShardedOutputProjection
from embrace_fairseq.core.tied_projection import TiedShardedProjection
from embrace_fairseq.core.vocab_parallel import AUTO, GATHER, OUTPUT_MODES
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding, is_sharded_param, sharded_embeddings
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, LAYOUTS, check_layout
from embrace_fairseq.core.node_topology import EXCHANGES, check_exchange
from embrace_fairseq.fairseq_adapter.scheduled_ddp import (
    SCHEDULE_FLAG, SCHEDULE_HELP, SCHEDULE_MODES, TRACE_FLAG, TRACE_HELP)
from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.process_group import resolve_group
from embrace_fairseq.fairseq_adapter import table_plan as TP
from embrace_fairseq.planner.cost import REPLICATE, VOCAB_PARALLEL
from embrace_fairseq.planner.plan import AUTO as PLAN_AUTO, Plan
from embrace_fairseq.schedule.plan import ScheduleOptions

logger = logging.getLogger(__name__)

LAYOUT_FLAG = "--embrace-shard-layout"
LAYOUT_HELP = ("which rank owns which embedding row: strided (id v on rank v mod N, balances the exchange of a "
               "frequency-sorted dictionary) or contiguous (one id range per rank)")
EXCHANGE_HELP = ("the route of embedding lookups: flat (every rank asks every owner; the default), node (ids "
                 "deduplicated per node before they cross to other nodes, rows fanned out inside the node), auto "
                 "(node when the job has several nodes of several ranks each). Same results either way")
TWO_LEVEL_HELP = ("with the 2D schedule on several nodes of several ranks (gloo): all-reduce the dense gradients "
                  "in two levels (inside the node, across nodes, inside again) instead of one ring over all ranks")
RANKS_PER_NODE_HELP = ("ranks on each node, for the node-aware exchange (default: EMBRACE_RANKS_PER_NODE, else "
                       "the launcher's LOCAL_WORLD_SIZE)")

#: stock architecture -> EmbRace architecture registered here
TRANSLATION_ARCHS = {
    "transformer": "embrace_transformer",
    "transformer_iwslt_de_en": "embrace_transformer_iwslt_de_en",
    "transformer_wmt_en_de": "embrace_transformer_wmt_en_de",
    "transformer_vaswani_wmt_en_de_big": "embrace_transformer_vaswani_wmt_en_de_big",
    "transformer_wmt_en_de_big": "embrace_transformer_wmt_en_de_big",
}
LM_ARCHS = {
    "transformer_lm": "embrace_transformer_lm",
    "transformer_lm_wiki103": "embrace_transformer_lm_wiki103",
    "transformer_lm_gpt": "embrace_transformer_lm_gpt",
}


class UnsupportedWithSharding(UserError, ValueError):
    """An option that cannot work with vocab-sharded embeddings."""


def check_supported(args: Any, lm: bool) -> None:
    """Stop at start-up on options whose embedding is not a plain table."""
    problems: List[str] = []
    if lm and safe_getattr(args, "adaptive_input", False):
        problems.append("--adaptive-input (its bands are separate tables; use a plain embedding)")
    if lm and safe_getattr(args, "character_embeddings", False):
        problems.append("--character-embeddings (no token table to shard)")
    if safe_getattr(args, "tie_adaptive_weights", False):
        problems.append("--tie-adaptive-weights")
    for flag in ("encoder_embed_path", "decoder_embed_path"):
        if safe_getattr(args, flag, None):
            problems.append(f"--{flag.replace('_', '-')} (load the vectors into the full table, then shard)")
    if safe_getattr(args, "base_layers", 0):
        problems.append("--base-layers")
    if safe_getattr(args, "model_parallel_size", 1) > 1:
        problems.append("--model-parallel-size > 1")
    if problems:
        raise UnsupportedWithSharding(
            "EmbRace architectures shard the token embedding over data-parallel ranks; these options "
            "cannot work with that: " + "; ".join(problems) + ". Use the stock architecture for them."
        )


@dataclass(frozen=True)
class TableOptions:
    """How the token tables are sharded and looked up (the ``--embrace-*`` table flags)."""

    layout: str = DEFAULT_LAYOUT
    exchange: str = "flat"
    ranks_per_node: Optional[int] = None


def build_sharded_embedding(dictionary, embed_dim: int, options: TableOptions = TableOptions()) -> ShardedEmbedding:
    # The default process group: every data-parallel rank holds a slice.
    return ShardedEmbedding(len(dictionary), embed_dim, padding_idx=dictionary.pad(), layout=options.layout,
                            exchange=options.exchange, ranks_per_node=options.ranks_per_node)


def table_options_of(args: Any) -> TableOptions:
    """The table flags of ``args`` (defaults where absent, as in older checkpoints)."""
    rpn = safe_getattr(args, "embrace_ranks_per_node", None)
    return TableOptions(
        layout=check_layout(safe_getattr(args, "embrace_shard_layout", None) or DEFAULT_LAYOUT),
        exchange=check_exchange(str(safe_getattr(args, "embrace_exchange", None) or "flat")),
        ranks_per_node=int(rpn) if rpn else None,
    )


# fairseq's TransformerModel hands build_embedding a TransformerConfig, which has no
# place for our flags: build_model keeps them here while it builds.
_building: List[TableOptions] = []


@contextlib.contextmanager
def _building_with(options: TableOptions) -> Iterator[None]:
    _building.append(options)
    try:
        yield
    finally:
        _building.pop()


@dataclass
class _Planned:
    """The plan of the model being built and the names of its tables in build order."""

    plan: Optional[Plan]
    names: List[str]

    def next_replicated(self) -> bool:
        name = self.names.pop(0) if self.names else None
        return name is not None and TP.choice(self.plan, name) == REPLICATE

    def output_choice(self) -> Optional[str]:
        return None if self.plan is None or TP.OUTPUT_PROJECTION not in dict(self.plan.choices) \
            else self.plan.choice(TP.OUTPUT_PROJECTION)


_planned: List[_Planned] = []


@contextlib.contextmanager
def _planning(plan: Optional[Plan], names: List[str]) -> Iterator[_Planned]:
    _planned.append(_Planned(plan, list(names)))
    try:
        yield _planned[-1]
    finally:
        _planned.pop()


def _next_replicated() -> bool:
    """Whether the table built now is one the plan replicates (consumes its name)."""
    return bool(_planned) and _planned[-1].next_replicated()


def _output_choice() -> Optional[str]:
    return _planned[-1].output_choice() if _planned else None


def stock_class(cls: type) -> type:
    """The fairseq model class an EmbRace architecture extends (its first fairseq base)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("fairseq."))


def fill_tied_keys(model: nn.Module, state_dict: Any) -> None:
    """Give every name of a tied parameter the value saved under another of its names, so
    a checkpoint saved where the output layer reads the table (a sharded plan's state dict
    names the table once) loads where it is the stock tied layer (two names), and back."""
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        have = [n for n in group if n in state_dict]
        for n in group if have else ():
            state_dict.setdefault(n, state_dict[have[0]])


class PlanFreeState:
    """``load_state_dict`` that takes a checkpoint saved under any plan."""

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):  # noqa: D401
        fill_tied_keys(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _options_for(args: Any) -> TableOptions:
    if safe_getattr(args, "embrace_shard_layout", None):
        return table_options_of(args)
    return _building[-1] if _building else TableOptions()


def mark_for_fairseq(model: nn.Module, args: Any = None, plan: Optional[Plan] = None) -> None:
    """Keep shards out of fairseq's data-parallel reduction, and note whether the 2D
    schedule takes that reduction over (``--embrace-schedule``, read by
    :mod:`.scheduled_ddp` when fairseq wraps the model).

    ``legacy_ddp`` skips parameters carrying ``expert`` (the BASE-layer convention);
    torch DDP (``c10d``) skips the names in ``_ddp_params_and_buffers_to_ignore``.
    The shards' gradients are complete after the AlltoAll of the backward pass.
    """
    model.embrace_schedule = str(safe_getattr(args, "embrace_schedule", None) or "on")
    model.embrace_plan = plan  # the plan it was built under (None: every table as the flags say)
    if plan is not None and plan.how == PLAN_AUTO:  # the plan decides the schedule and its sizes
        model.embrace_schedule = "on" if plan.schedule else "off"
        if plan.schedule:
            model.embrace_schedule_options = ScheduleOptions(piece_bytes=plan.piece_bytes, bucket_bytes=plan.bucket_bytes)
    model.embrace_trace = safe_getattr(args, "embrace_trace", None) or None
    model.embrace_two_level = bool(safe_getattr(args, "embrace_two_level_allreduce", False))
    names = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if is_sharded_param(p) and getattr(p, "_embrace_table")().is_sharded:
            p.expert = True
            names.append(name)
    if names:
        model._ddp_params_and_buffers_to_ignore = names
    for emb in sharded_embeddings(model):
        if emb.node_aware and emb.rank == 0:
            t = emb.topology
            logger.info(f"EmbRace exchange: node-aware, {t.num_nodes} nodes x {t.ranks_per_node} ranks "
                        f"({emb.num_embeddings} x {emb.embedding_dim} table)")


OUTPUT_HELP = (
    "how the output layer reads its vocab-sharded table in training: 'gather' all-gathers the table "
    "(and reduce-scatters its gradient), 'vocab-parallel' exchanges the hidden states instead and "
    "computes the loss over the shards (cross_entropy and label_smoothed_cross_entropy), 'auto' picks "
    "the cheaper per step. 'gather' also keeps an untied output projection replicated."
)


def output_mode(args: Any) -> str:
    mode = str(safe_getattr(args, "embrace_output", None) or AUTO)
    if mode not in OUTPUT_MODES:
        raise UnsupportedWithSharding(f"--embrace-output must be one of {', '.join(OUTPUT_MODES)}, got {mode!r}")
    return mode


class ShardedTiedOutputMixin:
    """Builds the output projection against a sharded table: tied to the embedding, or
    (untied) sharded like it unless ``--embrace-output gather``."""

    def __init__(self, *args, embrace_output: str = GATHER, **kwargs):
        self._embrace_output = embrace_output  # read by build_output_projection, during __init__
        self._embrace_output_choice = _output_choice()  # the plan's, for an untied output projection
        super().__init__(*args, **kwargs)

    def build_output_projection(self, cfg, dictionary, embed_tokens):  # noqa: D401
        mode = getattr(self, "_embrace_output", GATHER)
        plain = safe_getattr(cfg, "adaptive_softmax_cutoff", None) is None
        sharded = isinstance(embed_tokens, ShardedEmbedding) and embed_tokens.is_sharded
        if mode == "vocab-parallel" and not plain:
            raise UnsupportedWithSharding("--embrace-output vocab-parallel needs a plain output layer, "
                                          "not --adaptive-softmax-cutoff")
        untied = plain and not self.share_input_output_embed
        choice = getattr(self, "_embrace_output_choice", None)
        if untied and mode != GATHER and (choice == VOCAB_PARALLEL or (choice is None and sharded)):
            layout = embed_tokens.plan.layout if sharded else (_building[-1].layout if _building else DEFAULT_LAYOUT)
            self.output_projection = ShardedOutputProjection(
                self.output_embed_dim, len(dictionary), embed_tokens.group if sharded else resolve_group(None)[0],
                mode=mode, layout=layout)
            return self._after_output_projection(cfg)
        tied = self.share_input_output_embed and plain
        if not (tied and isinstance(embed_tokens, ShardedEmbedding)):
            return super().build_output_projection(cfg, dictionary, embed_tokens)
        # The stock decoder builds an nn.Linear here and then ties its weight; build
        # and drop one so the random stream (and so every later module) is identical.
        nn.Linear(embed_tokens.embedding_dim, embed_tokens.num_embeddings, bias=False)
        self.output_projection = TiedShardedProjection(embed_tokens, mode=mode)

    def _after_output_projection(self, cfg):
        # what the stock build_output_projection does after the projection (base layers)
        if safe_getattr(cfg, "base_layers", 0):
            raise UnsupportedWithSharding("--base-layers")


class EmbraceTransformerDecoderBase(ShardedTiedOutputMixin, TransformerDecoderBase):
    pass


class EmbraceTransformerDecoder(ShardedTiedOutputMixin, TransformerDecoder):
    pass


@register_model("embrace_transformer")
class EmbraceTransformerModel(PlanFreeState, TransformerModel):
    """``transformer`` with vocab-sharded token embeddings (``--arch embrace_transformer*``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--embrace-output", choices=OUTPUT_MODES, default=AUTO, help=OUTPUT_HELP)
        parser.add_argument(LAYOUT_FLAG, choices=list(LAYOUTS), default=DEFAULT_LAYOUT, help=LAYOUT_HELP)
        parser.add_argument("--embrace-exchange", choices=list(EXCHANGES), default="flat", help=EXCHANGE_HELP)
        parser.add_argument("--embrace-ranks-per-node", type=int, metavar="N", default=None, help=RANKS_PER_NODE_HELP)
        parser.add_argument("--embrace-two-level-allreduce", action="store_true", help=TWO_LEVEL_HELP)
        parser.add_argument(SCHEDULE_FLAG, choices=list(SCHEDULE_MODES), default="on", help=SCHEDULE_HELP)
        parser.add_argument(TRACE_FLAG, metavar="DIR", default=None, help=TRACE_HELP)
        parser.add_argument(TP.PLAN_FLAG, metavar="PLAN", default=None, help=TP.PLAN_HELP)

    @classmethod
    def build_model(cls, args, task):
        check_supported(args, lm=False)
        plan = TP.decide(args, task, stock_class(cls), TP.translation_tables(args, task), TP.TRANSLATION)
        shared = safe_getattr(args, "share_all_embeddings", False)
        names = [TP.SHARED] if shared else [TP.ENCODER, TP.DECODER]
        with _building_with(table_options_of(args)), _planning(plan, names):
            model = super().build_model(args, task)
        mark_for_fairseq(model, args, plan)
        return model

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        if _next_replicated():  # the stock table, all-reduced by fairseq's wrapper
            return super().build_embedding(args, dictionary, embed_dim, path)
        return build_sharded_embedding(dictionary, embed_dim, _options_for(args))

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return EmbraceTransformerDecoderBase(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention,
                                             embrace_output=output_mode(args))

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs):
        table = self.encoder.embed_tokens
        if table is self.decoder.embed_tokens and isinstance(table, ShardedEmbedding) and table.is_sharded:
            # One table read by encoder and decoder: one exchange for both lookups.
            table.prefetch(src_tokens, prev_output_tokens)
        return super().forward(src_tokens, src_lengths, prev_output_tokens, **kwargs)


# Built with make_dataclass: fairseq reads field types at run time, and this module's
# annotations are strings (``from __future__ import annotations``).
EmbraceTransformerLanguageModelConfig = make_dataclass(
    "EmbraceTransformerLanguageModelConfig",
    [("embrace_output", ChoiceEnum(list(OUTPUT_MODES)), field(default=AUTO, metadata={"help": OUTPUT_HELP})),
     ("embrace_shard_layout", ChoiceEnum(list(LAYOUTS)),
      field(default=DEFAULT_LAYOUT, metadata={"help": LAYOUT_HELP})),
     ("embrace_exchange", ChoiceEnum(list(EXCHANGES)), field(default="flat", metadata={"help": EXCHANGE_HELP})),
     ("embrace_ranks_per_node", Optional[int], field(default=None, metadata={"help": RANKS_PER_NODE_HELP})),
     ("embrace_two_level_allreduce", bool, field(default=False, metadata={"help": TWO_LEVEL_HELP})),
     ("embrace_schedule", ChoiceEnum(list(SCHEDULE_MODES)), field(default="on", metadata={"help": SCHEDULE_HELP})),
     ("embrace_trace", Optional[str], field(default=None, metadata={"help": TRACE_HELP})),
     ("embrace_plan", Optional[str], field(default=None, metadata={"help": TP.PLAN_HELP})),
     # the batch the plan prices: a model's configuration holds no dataset options, so
     # these read them as fairseq's own LM configuration reads the task's (II)
     ("embrace_max_tokens", Optional[int], field(default=II("dataset.max_tokens"), metadata={
         "help": "the tokens per batch the plan prices; follows --max-tokens (set it there)"})),
     ("embrace_batch_size", Optional[int], field(default=II("dataset.batch_size"), metadata={
         "help": "the sentences per batch the plan prices; follows --batch-size (set it there)"}))],
    bases=(TransformerLanguageModelConfig,),
)
EmbraceTransformerLanguageModelConfig.__module__ = __name__


@register_model("embrace_transformer_lm", dataclass=EmbraceTransformerLanguageModelConfig)
class EmbraceTransformerLanguageModel(PlanFreeState, TransformerLanguageModel):
    """``transformer_lm`` with a vocab-sharded token embedding (``--arch embrace_transformer_lm*``)."""

    @classmethod
    def build_model(cls, args, task):
        check_supported(args, lm=True)
        # Same steps as TransformerLanguageModel.build_model, with the EmbRace decoder.
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", 1024)
        plan = TP.decide(args, task, stock_class(cls), TP.lm_tables(args, task), TP.LM)
        with _building_with(table_options_of(args)), _planning(plan, [TP.DECODER]):
            embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
            decoder = EmbraceTransformerDecoder(args, task.target_dictionary, embed_tokens, no_encoder_attn=True,
                                                embrace_output=output_mode(args))
        model = cls(decoder)
        mark_for_fairseq(model, args, plan)
        return model

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        if _next_replicated():  # the stock table, all-reduced by fairseq's wrapper
            return super().build_embedding(args, dictionary, embed_dim, path)
        return build_sharded_embedding(dictionary, embed_dim, _options_for(args))


def _plain_table_defaults(stock_fn):
    """The stock wiki103 preset turns on adaptive input and adaptive softmax, and fairseq
    has no flag to turn them off; the EmbRace preset keeps its sizes with one plain table,
    sharded, tied to the output projection (unless the flags are given explicitly, which
    then stop at start-up as any adaptive option does)."""

    def arch(args):
        args.adaptive_input = safe_getattr(args, "adaptive_input", False)
        args.tie_adaptive_weights = safe_getattr(args, "tie_adaptive_weights", False)
        args.tie_adaptive_proj = safe_getattr(args, "tie_adaptive_proj", False)
        args.adaptive_softmax_cutoff = safe_getattr(args, "adaptive_softmax_cutoff", None)
        args.share_decoder_input_output_embed = safe_getattr(args, "share_decoder_input_output_embed", True)
        stock_fn(args)

    return arch


def _register_architectures() -> None:
    # Same presets as the stock architectures, under EmbRace names.
    for stock, ours in TRANSLATION_ARCHS.items():
        register_model_architecture("embrace_transformer", ours)(ARCH_CONFIG_REGISTRY[stock])
    for stock, ours in LM_ARCHS.items():
        if stock == "transformer_lm":
            continue  # registered by @register_model from the config dataclass, as fairseq does
        fn = ARCH_CONFIG_REGISTRY[stock]
        if stock == "transformer_lm_wiki103":
            fn = _plain_table_defaults(fn)
        register_model_architecture("embrace_transformer_lm", ours)(fn)


_register_architectures()
