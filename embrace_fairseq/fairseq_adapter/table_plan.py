"""``--embrace-plan``: what the planner is told about a fairseq model, and its answer.

The planner (:mod:`embrace_fairseq.planner`) decides per table from the model's tables,
its dense parameters, the tokens of a step, the world and the measured rates. This
module reads those from fairseq's arguments and task (the dense parameters by building
the stock model on the ``meta`` device: no memory, no random draw), runs the probe,
logs the plan on rank 0 and returns it; the architectures build what it says.
``shard`` (and a world of one) returns no plan: every table is built as the
``--embrace-*`` flags say, as before plans existed.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any, List, Optional, Sequence

import torch
from fairseq.utils import safe_getattr

from embrace_fairseq.core import collectives
from embrace_fairseq.core.node_topology import topology_for
from embrace_fairseq.planner.inputs import INPUT, OUTPUT, TIED, PlanInputs, Rates, TableInput
from embrace_fairseq.planner.plan import AUTO, PLAN_ENV, PLAN_MODES, SHARD, Plan, explicit_choices, parse_spec, resolve
from embrace_fairseq.planner.probe import check_agreed, measure_rates

logger = logging.getLogger(__name__)

PLAN_FLAG = "--embrace-plan"
PLAN_HELP = ("which embedding tables are sharded: 'auto' (default) measures the link and the compute at start-up "
             "and picks per table the cheapest of replicate (the stock path), row-shard and vocab-parallel "
             "output, never predicted slower than stock; 'shard' shards every table; 'replicate' none; or "
             "'table=choice,...' (e.g. 'embed_tokens=row-shard,output_projection=vocab-parallel'). The default "
             f"is {PLAN_ENV} when set")

#: the names of the tables, as the plan and its log lines say them
SHARED, ENCODER, DECODER, OUTPUT_PROJECTION = ("embed_tokens", "encoder.embed_tokens", "decoder.embed_tokens",
                                               "decoder.output_projection")
ROBERTA_TABLE = "encoder.sentence_encoder.embed_tokens"


def plan_spec(args: Any) -> str:
    """``--embrace-plan``, else ``EMBRACE_PLAN``, else ``auto``; checked."""
    spec = str(safe_getattr(args, "embrace_plan", None) or os.environ.get(PLAN_ENV, "") or AUTO).strip()
    if spec not in PLAN_MODES:
        parse_spec(spec)  # stops on a malformed plan before anything is built
    return spec


def _tokens(args: Any) -> int:
    """Tokens per rank per step (a batch of --max-tokens, else --batch-size sequences)."""
    max_tokens = safe_getattr(args, "max_tokens", None)
    if max_tokens:
        return int(max_tokens)
    length = safe_getattr(args, "tokens_per_sample", None) or safe_getattr(args, "max_source_positions", None) or 512
    return int(safe_getattr(args, "batch_size", None) or 1) * int(length)


def translation_tables(args: Any, task: Any) -> List[TableInput]:
    t = _tokens(args)
    plain = safe_getattr(args, "adaptive_softmax_cutoff", None) is None
    tied = bool(safe_getattr(args, "share_decoder_input_output_embed", False) or
                safe_getattr(args, "share_all_embeddings", False)) and plain
    dim = int(args.decoder_embed_dim)
    if safe_getattr(args, "share_all_embeddings", False):
        tables = [TableInput(SHARED, len(task.source_dictionary), dim, TIED if tied else INPUT, lookups_per_rank=2 * t,
                             output_tokens_per_rank=t if tied else 0)]
    else:
        tables = [TableInput(ENCODER, len(task.source_dictionary), int(args.encoder_embed_dim), INPUT,
                             lookups_per_rank=t),
                  TableInput(DECODER, len(task.target_dictionary), dim, TIED if tied else INPUT, lookups_per_rank=t,
                             output_tokens_per_rank=t if tied else 0)]
    if not tied:
        tables.append(TableInput(OUTPUT_PROJECTION, len(task.target_dictionary), int(args.decoder_output_dim or dim),
                                 OUTPUT, output_tokens_per_rank=t, plain_output=plain))
    return tables


def lm_tables(args: Any, task: Any) -> List[TableInput]:
    t = _tokens(args)
    plain = safe_getattr(args, "adaptive_softmax_cutoff", None) is None
    tied = bool(safe_getattr(args, "share_decoder_input_output_embed", False)) and plain
    tables = [TableInput(DECODER, len(task.source_dictionary), int(args.decoder_input_dim), TIED if tied else INPUT,
                         lookups_per_rank=t, output_tokens_per_rank=t if tied else 0)]
    if not tied:
        tables.append(TableInput(OUTPUT_PROJECTION, len(task.target_dictionary), int(args.decoder_output_dim),
                                 OUTPUT, output_tokens_per_rank=t, plain_output=plain))
    return tables


def roberta_tables(args: Any, task: Any) -> List[TableInput]:
    t = _tokens(args)
    tied = not safe_getattr(args, "untie_weights_roberta", False)
    masked = max(1, int(t * float(safe_getattr(args, "mask_prob", 0.15))))
    # untied, the head keeps the stock replicated projection: not a table of the plan
    return [TableInput(ROBERTA_TABLE, len(task.source_dictionary), int(args.encoder_embed_dim),
                       TIED if tied else INPUT, lookups_per_rank=t, output_tokens_per_rank=masked if tied else 0,
                       output_bias=tied)]  # the LM head's bias


def _dense_numel(stock_cls: Any, args: Any, task: Any, tables: Sequence[TableInput]) -> int:
    """Parameters of the stock model other than the plan's tables, counted on a ``meta``
    build (the random stream untouched)."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = stock_cls.build_model(copy.deepcopy(args), task)
        except Exception:  # a module that cannot be built on meta: build it on the CPU, once
            model = stock_cls.build_model(copy.deepcopy(args), task)
    total = sum(p.numel() for p in model.parameters())
    return max(0, total - sum(t.numel for t in tables))


def decide(args: Any, task: Any, stock_cls: Any, tables: List[TableInput]) -> Optional[Plan]:
    """The plan for this build (collective on the default group), or None: build every
    table sharded as the flags say (``shard``, or a world of one)."""
    spec = plan_spec(args)
    n = collectives.world_size()
    if spec == SHARD:
        return None
    if n <= 1:  # a plain table whatever the plan; an explicit one is still checked
        if spec not in PLAN_MODES:
            explicit_choices(PlanInputs(tuple(tables), 0, 1, 1, Rates(1.0, 0.0, 0.0),
                                        output_mode=str(safe_getattr(args, "embrace_output", None) or AUTO)), spec)
        return None
    started = time.perf_counter()
    dense = _dense_numel(stock_cls, args, task, tables)
    half = bool(safe_getattr(args, "fp16", False) or safe_getattr(args, "bf16", False))
    device = torch.device("cuda") if torch.cuda.is_available() and not safe_getattr(args, "cpu", False) else None
    tokens = _tokens(args)
    with torch.random.fork_rng():  # the probe's random operands leave the model's draw as stock's
        rates = measure_rates(dense, tables, tokens, max(t.dim for t in tables), device=device)
    rpn = topology_for(n, safe_getattr(args, "embrace_ranks_per_node", None)).ranks_per_node
    inputs = PlanInputs(tuple(tables), dense, n, rpn, rates, element_size=2 if half else 4, id_size=8,
                        output_mode=str(safe_getattr(args, "embrace_output", None) or AUTO))
    schedule = str(safe_getattr(args, "embrace_schedule", None) or "on") == "on"
    plan = resolve(inputs, spec, schedule)
    check_agreed(f"{plan.spec()};{plan.schedule};{plan.bucket_bytes};{plan.piece_bytes}")
    plan = dataclasses.replace(plan, planning_s=time.perf_counter() - started)
    if collectives.rank() == 0:
        for line in plan.lines(inputs):
            logger.info(line)
    return plan


def choice(plan: Optional[Plan], name: str) -> Optional[str]:
    """The plan's choice for ``name``; None without a plan (build as the flags say)."""
    return None if plan is None else plan.choice(name)
