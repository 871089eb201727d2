"""``--embrace-plan``: what the planner is told about a fairseq model, and its answer.

The planner (:mod:`embrace_fairseq.planner`) decides per table from the model's tables,
its dense parameters, the tokens of a step, the world and the measured rates. This
module reads those from fairseq's arguments and task, builds the stock model on the
device and times its forward and backward on a made-up batch of the run's shape (the
compute the plan is priced with; the random stream forked, so the model's own draws stay
as stock's), runs the link probe, logs the plan on rank 0 and returns it; the
architectures build what it says.
``shard`` (and a world of one) returns no plan: every table is built as the
``--embrace-*`` flags say, as before plans existed.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

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


def _option(args: Any, *names: str) -> Optional[int]:
    """The first of ``names`` set to a number (an interpolation not resolved counts as unset)."""
    for name in names:
        try:
            value = safe_getattr(args, name, None)
        except Exception:  # an interpolation whose root is absent (a model config on its own)
            value = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value)
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def _tokens(args: Any) -> int:
    """Tokens per rank per step (a batch of --max-tokens, else --batch-size sequences). A
    dataclass model's configuration reads the dataset's options through interpolations
    (``embrace_max_tokens``, ``embrace_batch_size``); a legacy one holds them itself."""
    max_tokens = _option(args, "max_tokens", "embrace_max_tokens")
    if max_tokens:
        return max_tokens
    length = _option(args, "tokens_per_sample", "max_source_positions") or 512
    return (_option(args, "batch_size", "embrace_batch_size") or 1) * length


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


#: how each family's stock model is run on a made-up batch (:func:`_made_up_batch`)
TRANSLATION, LM, MASKED_LM = "translation", "lm", "masked_lm"
#: a translation batch's sentence length (a --max-tokens batch holds tokens / length pairs)
SENTENCE_TOKENS = 32


def _made_up_batch(kind: str, args: Any, task: Any, tokens: int, device: torch.device
                   ) -> Tuple[Tuple[Any, ...], Dict[str, Any], torch.Tensor]:
    """(args, kwargs, targets) of one forward of ``kind`` over about ``tokens`` tokens per
    side, with ids drawn from a generator of its own (the global stream untouched)."""
    g = torch.Generator().manual_seed(0)
    dictionary = task.source_dictionary
    low, high = dictionary.nspecial, max(dictionary.nspecial + 1, len(dictionary))
    if kind == TRANSLATION:
        length = max(1, min(SENTENCE_TOKENS, int(safe_getattr(args, "max_source_positions", SENTENCE_TOKENS)) - 2))
    else:
        length = max(1, min(tokens, int(safe_getattr(args, "tokens_per_sample", None) or 512),
                            int(safe_getattr(args, "max_positions", None) or safe_getattr(args, "max_target_positions",
                                                                                          None) or 10 ** 9) - 2))
    rows = max(1, tokens // length)

    def ids() -> torch.Tensor:
        return torch.randint(low, high, (rows, length), generator=g).to(device)

    src = ids()
    if kind == TRANSLATION:
        lengths = torch.full((rows,), length, dtype=torch.long, device=device)
        return (src, lengths, ids()), {}, ids()
    if kind == LM:
        return (src,), {}, ids()
    if kind == MASKED_LM:
        mask = torch.rand((rows, length), generator=g).to(device) < float(safe_getattr(args, "mask_prob", 0.15))
        mask[:, 0] = True  # at least one masked token a row
        return (src,), {"masked_tokens": mask}, src[mask]
    raise ValueError(f"no made-up batch for {kind!r}; one of {TRANSLATION}, {LM}, {MASKED_LM}")


def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy in fp32 as fairseq's criteria compute it; an output that is not over the
    vocabulary (an adaptive softmax's features) is priced by its forward and backward only."""
    out = out.float()
    if out.dim() >= 2 and out.shape[:-1] == targets.shape:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1) % out.size(-1))
    return out.pow(2).mean()


def _stock_model(stock_cls: Any, args: Any, task: Any, device: Optional[torch.device]) -> torch.nn.Module:
    with torch.device(device or "cpu"):
        return stock_cls.build_model(copy.deepcopy(args), task).to(device or "cpu")


def _dense_numel(model: torch.nn.Module, tables: Sequence[TableInput]) -> int:
    return max(0, sum(p.numel() for p in model.parameters()) - sum(t.numel for t in tables))


def _meta_dense_numel(stock_cls: Any, args: Any, task: Any, tables: Sequence[TableInput]) -> int:
    """The dense parameters counted on a ``meta`` build (no memory, no random draw)."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = stock_cls.build_model(copy.deepcopy(args), task)
        except Exception:  # a module that cannot be built on meta: build it on the CPU, once
            model = stock_cls.build_model(copy.deepcopy(args), task)
    return _dense_numel(model, tables)


def _probe(args: Any, task: Any, stock_cls: Any, kind: Optional[str], tables: List[TableInput],
           device: Optional[torch.device], dtype: torch.dtype, n: int) -> Tuple[int, Rates]:
    """(dense parameters, rates): the stock model built on the device and its forward,
    backward and Adam update timed on a made-up batch of the run's shape (the compute floor
    of a step);
    where that cannot run (no ``kind``, or the stock model does not fit), the FLOP probe.
    Under a forked random stream: the model's draws stay as stock's."""
    tokens, dim = _tokens(args), max(t.dim for t in tables)
    with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
        model, step = None, None
        if kind is not None:
            try:
                model = _stock_model(stock_cls, args, task, device).to(dtype).train()
                a, kw, targets = _made_up_batch(kind, args, task, tokens, device or torch.device("cpu"))
                opt = torch.optim.Adam(model.parameters(), lr=1e-9)  # the update is part of the step

                def step() -> None:
                    _loss(model(*a, **kw)[0], targets).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                step()  # fails here, not inside the collective probe, when it cannot run
            except Exception as e:  # out of memory, or a model the made-up batch does not fit
                logger.warning("EmbRace plan: the stock model's step could not be timed (%s: %s); the compute is "
                               "priced from a matrix product instead", type(e).__name__, str(e).splitlines()[0])
                model, step = None, None
        dense = _dense_numel(model, tables) if model is not None else _meta_dense_numel(stock_cls, args, task, tables)
        rates = measure_rates(dense, tables, tokens, dim, device=device, dtype=dtype, step=step)
        del model, step
    return dense, rates


def decide(args: Any, task: Any, stock_cls: Any, tables: List[TableInput], kind: Optional[str] = None
           ) -> Optional[Plan]:
    """The plan for this build (collective on the default group), or None: build every
    table sharded as the flags say (``shard``, or a world of one). ``kind``: how the stock
    model is run to time its step (:data:`TRANSLATION`, :data:`LM`, :data:`MASKED_LM`)."""
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
    half = bool(safe_getattr(args, "fp16", False) or safe_getattr(args, "bf16", False))
    device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() and not safe_getattr(args, "cpu", False) else None
    dtype = torch.float32 if device is None or not half else \
        (torch.bfloat16 if safe_getattr(args, "bf16", False) else torch.float16)
    dense, rates = _probe(args, task, stock_cls, kind, tables, device, dtype, n)
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
