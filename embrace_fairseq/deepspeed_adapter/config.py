"""The ``"embrace"`` section of a DeepSpeed JSON config: parsing and validation.

DeepSpeed ignores unknown top-level keys silently, so the section is validated here
(an unknown key or a bad value stops start-up with an error naming it) and removed
before the rest of the config reaches DeepSpeed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.node_topology import EXCHANGES
from embrace_fairseq.core.shard_plan import LAYOUTS

SECTION = "embrace"
OUTPUT_MODES = ("auto", "vocab-parallel", "gather")  # as embrace_fairseq.core.vocab_parallel.OUTPUT_MODES


class EmbraceConfigError(UserError, ValueError):
    """The ``"embrace"`` section (or its combination with the DeepSpeed config) is invalid."""


@dataclass(frozen=True)
class EmbraceConfig:
    """Switches and sizes of the EmbRace DeepSpeed hook (all optional in the JSON).

    model_level: order dense collectives by layer, input-near first (off: readiness order).
    live_queue: on gloo, issue dense pieces from a priority queue over the buckets ready
        on every rank (agreed before each issue) instead of the static list
        (:mod:`embrace_fairseq.schedule.executor`).
    exchange_gate: with the model level, hold new dense pieces back while an embedding
        gradient exchange is in flight, so that it goes first. Off by default: where the
        step waits for every gradient a held piece only idles the link, and with
        next-forward overlap it did not pay on the benchmark's models
        (docs/PERFORMANCE.md); for a machine whose link, not its ranks' drift, limits the
        exchange the next forward waits for.
    tensor_level: cut buckets into pieces of ``piece_bytes`` (off: whole buckets).
    overlap: issue the all-reduces during backward (off: after backward, like stock DeepSpeed).
    piece_bytes: largest collective the tensor level issues.
    max_in_flight: collectives outstanding at once (credit).
    bucket_bytes: size of the flat buffers gradients are grouped into.
    compute_bytes_per_s, link_bytes_per_s: the relative speeds of backward (gradient bytes
        produced per second) and of the all-reduce link that the schedule's static issue
        list is simulated with (:class:`~embrace_fairseq.schedule.plan.ScheduleOptions`);
        they shape that order only, never gate anything at run time. ``null`` (default):
        measured on the ranks (the link at start-up, backward over the first step;
        :mod:`embrace_fairseq.schedule.rates`), the same figures on every rank.
    trace: ``None`` or a path prefix: write ``<prefix>.rank<N>.json`` Chrome traces.
    relaxed_embedding: update the embedding rows the next batch reads at the step and
        finish the others (gradient exchange and update) while the next forward runs.
        Give the next batch with ``engine.embrace.next_batch(...)``. Not with gradient
        clipping, fp16/bf16 or gradient accumulation (refused at start-up).
    output: how the output layer reads its sharded table in training (``embrace-ds-train``
        with fairseq's cross_entropy / label_smoothed_cross_entropy): ``"auto"`` (cheaper
        per step), ``"vocab-parallel"`` or ``"gather"``; the same as ``--embrace-output``.
    next_forward: cross-iteration overlap: the step does not wait for the dense
        all-reduce; each layer's parameters are updated when the next forward reaches the
        layer (:mod:`embrace_fairseq.schedule.next_forward`), the same result as the whole
        step. Applies at ZeRO stage 0 in fp32 without gradient clipping, with a torch
        Adam, AdamW or SGD optimizer and without the relaxed embedding dependency;
        elsewhere the schedule overlaps backward only and says why once in the log.
    shard_layout: which rank owns which embedding row, ``"strided"`` (id ``v`` on rank
        ``v % N``: balances the exchange of a frequency-sorted vocabulary) or
        ``"contiguous"`` (one id range per rank). ``None`` keeps the layout the tables
        were built with (``"strided"`` unless ``--embrace-shard-layout`` said otherwise);
        a table built with another layout is re-sharded when the hook attaches (before
        the first step). ``embrace-ds-train`` builds the model with it directly.
    exchange: the route of embedding lookups, ``"auto"``, ``"node"`` or ``"flat"``
        (:mod:`embrace_fairseq.core.node_exchange`; the same as ``--embrace-exchange``).
        ``None`` keeps what the tables were built with (``"flat"`` unless the flag said
        otherwise).
    ranks_per_node: ranks on each node for the node-aware exchange (``None``:
        ``EMBRACE_RANKS_PER_NODE``, else the launcher's ``LOCAL_WORLD_SIZE``).
    defer_output_grad: with ``overlap``, a vocab-parallel output layer's table gradient
        is computed after the backward (at the step, before it waits for the dense
        all-reduce) instead of in the output layer's backward: the layers below start
        their backward and their all-reduce one large product earlier, and the product
        runs while the all-reduce is in flight (:mod:`embrace_fairseq.core.vocab_parallel`).
        The same gradients.
    plan: which embedding tables ``embrace-ds-train`` builds sharded, as ``--embrace-plan``:
        ``"auto"`` (the planner's choice from the rates measured at build, never predicted
        slower than stock), ``"shard"``, ``"replicate"`` or ``"table=choice,..."``. ``None``
        (default): the flag's value, else ``EMBRACE_PLAN``, else ``"auto"``. A replicated
        table is a plain parameter the hook reduces with the dense ones.
    two_level_allreduce: on several nodes of several ranks, all-reduce the dense pieces
        in two levels on gloo (inside the node, across on the rails, inside again: less
        across nodes). Default ``false`` (one ring over all ranks): NCCL already builds
        node-aware rings and trees, and the two levels have run on emulated nodes only, faster
        than one ring on the translation model (results/bench/regime/nodes_2x2) and no faster on
        the untied LM (results/bench/nodes_2x2_ablation); docs/PERFORMANCE.md.
    """

    model_level: bool = True
    tensor_level: bool = True
    overlap: bool = True
    piece_bytes: int = 1 << 20
    max_in_flight: int = 2
    bucket_bytes: int = 4 << 20
    compute_bytes_per_s: Optional[float] = None
    link_bytes_per_s: Optional[float] = None
    trace: Optional[str] = None
    relaxed_embedding: bool = False
    output: str = "auto"
    shard_layout: Optional[str] = None
    next_forward: bool = False
    exchange_gate: bool = False
    live_queue: bool = False
    exchange: Optional[str] = None
    ranks_per_node: Optional[int] = None
    two_level_allreduce: bool = False
    defer_output_grad: bool = True
    plan: Optional[str] = None


_BOOLS = {"model_level", "tensor_level", "overlap", "relaxed_embedding", "next_forward", "exchange_gate", "live_queue",
          "two_level_allreduce", "defer_output_grad"}
_POSITIVE_INTS = {"piece_bytes", "max_in_flight", "bucket_bytes"}
_POSITIVE_NUMBERS = {"compute_bytes_per_s", "link_bytes_per_s"}


def parse_embrace_config(section: Optional[Mapping[str, Any]]) -> EmbraceConfig:
    """Validate the ``"embrace"`` mapping; ``None`` or ``{}`` gives the defaults."""
    if section is None:
        return EmbraceConfig()
    if not isinstance(section, Mapping):
        raise EmbraceConfigError(f'"{SECTION}" must be a JSON object, got {type(section).__name__}')
    known = [f.name for f in fields(EmbraceConfig)]
    values: Dict[str, Any] = {}
    for key, value in section.items():
        where = f'"{SECTION}.{key}"'
        if key not in known:
            raise EmbraceConfigError(f"unknown key {where}; valid keys are: {', '.join(known)}")
        if key in _BOOLS and not isinstance(value, bool):
            raise EmbraceConfigError(f"{where} must be true or false, got {value!r}")
        if key in _POSITIVE_INTS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EmbraceConfigError(f"{where} must be a positive integer, got {value!r}")
        if key in _POSITIVE_NUMBERS and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise EmbraceConfigError(f"{where} must be a positive number (bytes per second), got {value!r}")
            value = float(value)
        if key == "output" and value not in OUTPUT_MODES:
            raise EmbraceConfigError(f"{where} must be one of {', '.join(map(repr, OUTPUT_MODES))}, got {value!r}")
        if key == "trace" and value is not None and (not isinstance(value, str) or not value):
            raise EmbraceConfigError(f"{where} must be null or a non-empty path prefix, got {value!r}")
        if key == "exchange" and value is not None and value not in EXCHANGES:
            raise EmbraceConfigError(f"{where} must be null or one of {', '.join(repr(x) for x in EXCHANGES)}, got {value!r}")
        if key == "ranks_per_node" and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                              or value < 1):
            raise EmbraceConfigError(f"{where} must be null or a positive integer, got {value!r}")
        if key == "shard_layout" and value is not None and value not in LAYOUTS:
            raise EmbraceConfigError(f"{where} must be null or one of {', '.join(repr(x) for x in LAYOUTS)}, got {value!r}")
        if key == "plan" and value is not None:
            _check_plan(where, value)
        values[key] = value
    return EmbraceConfig(**values)


class ConfigFileError(EmbraceConfigError):
    """The ``--deepspeed-config`` file is missing, unreadable, not JSON or not a JSON object."""


def load_json_config(path: str) -> Dict[str, Any]:
    """The JSON object in ``path``; a missing file or malformed JSON stops with
    :class:`ConfigFileError` naming the file (and the line and column of the JSON error)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read the DeepSpeed config {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"the DeepSpeed config {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigFileError(f"the DeepSpeed config {path} must hold a JSON object ({{...}}), "
                              f"not a {type(config).__name__}")
    return config


def _check_plan(where: str, value: Any) -> None:
    from embrace_fairseq.planner.plan import PLAN_MODES, PlanError, parse_spec

    if not isinstance(value, str) or not value.strip():
        raise EmbraceConfigError(f"{where} must be null, one of {', '.join(map(repr, PLAN_MODES))} or "
                                 f"\"table=choice,...\", got {value!r}")
    if value.strip() not in PLAN_MODES:
        try:
            parse_spec(value)
        except PlanError as e:
            raise EmbraceConfigError(f"{where}: {e}") from None


def split_config(config: Union[None, str, Mapping[str, Any]]) -> Tuple[Optional[Dict[str, Any]], EmbraceConfig]:
    """(DeepSpeed config without the section, parsed section). ``config`` is a dict or a JSON path."""
    if config is None:
        return None, EmbraceConfig()
    if isinstance(config, str):
        config = load_json_config(config)
    if not isinstance(config, Mapping):
        raise EmbraceConfigError(f"a DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}")
    ds = copy.deepcopy(dict(config))
    return ds, parse_embrace_config(ds.pop(SECTION, None))


#: ZeRO stages the hook runs: 0 (the 2D schedule reduces the dense gradients), 1 and 2
#: (DeepSpeed partitions the dense optimizer state, and at 2 the dense gradients too; the
#: table shards are stepped by the shard optimizer)
SUPPORTED_ZERO_STAGES = (0, 1, 2)


def zero_stage_refusal(stage: int) -> str:
    """The one-line reason a ZeRO stage is refused, and what to use instead."""
    if stage == 3:
        return ('"zero_optimization.stage": 3 is not supported with sharded embedding tables: stage 3 turns every '
                "parameter of the module, the table shards included, into a partitioned parameter (broadcast from "
                "rank 0, split, gathered again by its own forward hooks), but each rank's shard holds other rows: "
                "the tables are already partitioned by rows. Use stage 2: DeepSpeed partitions the dense gradients and optimizer "
                "state, and each rank keeps 1/N of the tables, their gradients and their optimizer state.")
    return (f'"zero_optimization.stage": {stage} is not a ZeRO stage the EmbRace hook runs; use 0, 1 or 2 '
            "(stage 3 is refused with sharded tables)")


def check_supported(ds: Mapping[str, Any], embrace: Optional[EmbraceConfig] = None) -> None:
    """Refuse, before DeepSpeed starts, the combinations the hook cannot run correctly."""
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if stage not in SUPPORTED_ZERO_STAGES:
        raise EmbraceConfigError(zero_stage_refusal(stage))
    if (ds.get("bf16") or {}).get("enabled", False) and stage == 0:
        raise EmbraceConfigError(
            '"bf16.enabled" with "zero_optimization.stage": 0: DeepSpeed\'s stage-0 bf16 optimizer copies '
            "gradients into its own fp32 buffers at the end of backward, before the scheduled all-reduce "
            "completes; use bf16 with stage 1"
        )
    if embrace is not None and embrace.relaxed_embedding:
        relaxed = f'"{SECTION}.relaxed_embedding": true'
        if float(ds.get("gradient_clipping", 0.0) or 0.0) > 0:
            raise EmbraceConfigError(f'{relaxed} with "gradient_clipping" > 0: the global gradient norm needs every row\'s '
                                     "gradient at the step, which the relaxed dependency delivers later; disable one of them")
        for key in ("fp16", "bf16"):
            if (ds.get(key) or {}).get("enabled", False):
                raise EmbraceConfigError(f'{relaxed} with "{key}.enabled": the overflow check needs every row\'s gradient '
                                         "at the step; use fp32 or disable the relaxed dependency")
        if int(ds.get("gradient_accumulation_steps", 1) or 1) > 1:
            raise EmbraceConfigError(f'{relaxed} with "gradient_accumulation_steps" > 1 is not supported')
    if stage == 0 and (ds.get("fp16") or {}).get("enabled", False) and float(ds.get("gradient_clipping", 0.0) or 0.0) > 0:
        raise EmbraceConfigError(
            '"gradient_clipping" with "fp16.enabled" at ZeRO stage 0: DeepSpeed\'s fp16 optimizer takes the gradient norm '
            "per rank, which would miss the other ranks' table shards; disable one of them"
        )
