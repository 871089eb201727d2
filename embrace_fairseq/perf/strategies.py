"""The data-parallel strategies, each registered once, in the style of fairseq's registries.

A strategy is registered under one name with everything the performance tools need
of it: its byte formula (:mod:`embrace_fairseq.planner.volume`, what :func:`.bounds.min_bytes_per_step`
returns), its cost in the alpha-beta simulator (:mod:`.simulator`), its builder in
the emulated-cluster benchmark (:mod:`.bench`), a label for reports and the aliases
users and older JSON files call it by. Everything else looks strategies up here
(:func:`get_strategy`), so adding a strategy is one :func:`register_strategy` call.

Importing this module stays cheap: the simulator costs (numpy) and the benchmark
builders (torch, fairseq, DeepSpeed) are named by module and attribute and imported
on first call (:class:`LazyRef`); the byte formulas are plain arithmetic.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from embrace_fairseq.planner import volume as V

# the strategy every speedup is "of", the same with its schedule off (what the schedule
# gains), and the stock one losses and compute are measured against
SPEEDUP_SUBJECT = "embrace_schedule"
UNSCHEDULED_SUBJECT = "embrace_noschedule"
REFERENCE = "fairseq_legacy_ddp"
#: the compute-only floor: the same steps with every collective skipped
FLOOR = "compute_floor"


@dataclass(frozen=True)
class LazyRef:
    """A function named by module and attribute, imported when first called."""

    module: str
    attr: str

    def resolve(self) -> Callable[..., Any]:
        return getattr(importlib.import_module(self.module), self.attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


@dataclass(frozen=True)
class StrategySpec:
    """One data-parallel strategy and its parts, keyed by :attr:`name`."""

    name: str
    label: str  # for tables and plots, e.g. "(b) DeepSpeed stock"
    short: str  # a column header, e.g. "DeepSpeed"
    description: str
    aliases: Tuple[str, ...]
    volume: Callable[[V.StepTraffic], Dict[str, float]]  # bytes per rank per step by kind
    cost: Callable[..., Any]  # simulator: (CostContext) -> Prediction
    build: Callable[..., Any]  # benchmark: (workload, task, data, counter, trace_prefix) -> bench Strategy
    shards_table: bool = False  # EmbRace: the table is vocab-sharded, its bytes come from the ledger
    # EmbRace under DeepSpeed ZeRO: DeepSpeed reduces the dense gradients itself, so their
    # bytes come from its counted collectives, not from EmbRace's ledger
    dense_by_deepspeed: bool = False
    #: the planner decides at build, from the link it is built on, what it shards (the
    #: default plan): neither a baseline nor a fixed EmbRace configuration
    planned: bool = False


_REGISTRY: Dict[str, StrategySpec] = {}
_ALIASES: Dict[str, str] = {}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register_strategy(name: str, *, label: str, short: str, description: str,
                      volume: Callable[[V.StepTraffic], Dict[str, float]], cost: Callable[..., Any],
                      build: Callable[..., Any], aliases: Tuple[str, ...] = (),
                      shards_table: bool = False, dense_by_deepspeed: bool = False,
                      planned: bool = False) -> StrategySpec:
    """Register a strategy under ``name`` (and its aliases); a name taken twice raises."""
    if _key(name) != name:
        raise ValueError(f"strategy names are lower case with underscores, got {name!r}")
    for n in (name, *(_key(a) for a in aliases)):
        if n in _REGISTRY or n in _ALIASES:
            raise ValueError(f"strategy name {n!r} is registered already")
    spec = StrategySpec(name, label, short, description, tuple(aliases), volume, cost, build, shards_table,
                        dense_by_deepspeed, planned)
    _REGISTRY[name] = spec
    _ALIASES.update({_key(a): name for a in aliases})
    return spec


def strategy_names() -> Tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_REGISTRY)


def canonical_strategy(name: str) -> str:
    """The registered name of ``name`` or of its alias (case, ``-`` or ``_`` alike)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(_REGISTRY)}")
    return key


def get_strategy(name: str) -> StrategySpec:
    """The registered strategy of ``name`` or of its alias; ``ValueError`` naming the known ones."""
    return _REGISTRY[canonical_strategy(name)]


def aliases() -> Dict[str, str]:
    """Alias -> registered name."""
    return dict(_ALIASES)


def sharded_strategies() -> List[str]:
    """The strategies that shard the table (EmbRace's)."""
    return [s.name for s in _REGISTRY.values() if s.shards_table]


def is_baseline(name: str) -> bool:
    """A stock strategy: neither EmbRace's (fixed or planned) nor the floor."""
    spec = get_strategy(name)
    return not (spec.shards_table or spec.planned or spec.name == FLOOR)


# ------------------------------------------------------------------ the strategies

_COSTS = "embrace_fairseq.perf.simulator.allreduce_costs"
_EMBRACE_COSTS = "embrace_fairseq.perf.simulator.embrace_costs"
_BUILDERS = "embrace_fairseq.perf.bench.builders"

register_strategy(
    "fairseq_legacy_ddp", label="(a) fairseq legacy_ddp", short="legacy_ddp",
    aliases=("legacy_ddp", "fairseq", "fairseq_stock", "a"),
    description="stock fairseq model, LegacyDistributedDataParallel: backward, then every gradient all-reduced "
                "in flat buffers of up to 2**28 elements, then the optimizer",
    volume=V.dense_allreduce, cost=LazyRef(_COSTS, "legacy_ddp"), build=LazyRef(_BUILDERS, "build_legacy_ddp"),
)
register_strategy(
    "fairseq_c10d", label="(a') fairseq c10d (torch DDP)", short="c10d", aliases=("c10d",),
    description="stock fairseq model under torch DDP: fairseq's 25 MB buckets and torch's 1 MiB first bucket, "
                "scaled with the model, all-reduced in readiness order during the backward (the input table is "
                "ready last)",
    volume=V.dense_allreduce, cost=LazyRef(_COSTS, "c10d"), build=LazyRef(_BUILDERS, "build_c10d"),
)
register_strategy(
    "deepspeed", label="(b) DeepSpeed stock", short="DeepSpeed", aliases=("deepspeed_stock", "zero0", "b"),
    description="stock model, stock DeepSpeed engine (ZeRO-0): one all-reduce after the backward, no overlap",
    volume=V.dense_allreduce, cost=LazyRef(_COSTS, "deepspeed"), build=LazyRef(_BUILDERS, "build_deepspeed"),
)
register_strategy(
    "deepspeed_zero1", label="(b1) DeepSpeed ZeRO-1", short="ZeRO-1", aliases=("zero1", "b1"),
    description="stock model, DeepSpeed ZeRO stage 1 (overlap_comm, contiguous_gradients, reduced to the owner, "
                "5e8-element buckets scaled with the model): "
                "gradient buckets reduced after the backward, each rank steps its 1/N of the optimizer state, "
                "the updated partitions all-gathered",
    volume=V.zero_partitioned, cost=LazyRef(_COSTS, "zero1"), build=LazyRef(_BUILDERS, "build_deepspeed_zero1"),
)
register_strategy(
    "deepspeed_zero2", label="(b2) DeepSpeed ZeRO-2", short="ZeRO-2", aliases=("zero2", "b2"),
    description="stock model, DeepSpeed ZeRO stage 2 (overlap_comm, contiguous_gradients, reduced to the owner, "
                "5e8-element buckets scaled with the model): "
                "gradients reduced in buckets during the backward and partitioned, each rank steps its 1/N, "
                "the updated partitions all-gathered",
    volume=V.zero_partitioned, cost=LazyRef(_COSTS, "zero2"), build=LazyRef(_BUILDERS, "build_deepspeed_zero2"),
)
register_strategy(
    "sparse_allgather", label="(c) sparse all-gather (DeepSpeed)", short="sparse all-gather", aliases=("sparse", "c"),
    description="nn.Embedding(sparse=True) under DeepSpeed: dense gradients all-reduced, the coalesced sparse "
                "table gradient all-gathered (sizes, int64 indices, values, blocks padded to the largest)",
    volume=V.sparse_allgather, cost=LazyRef(_COSTS, "sparse_allgather"),
    build=LazyRef(_BUILDERS, "build_sparse_allgather"),
)
register_strategy(
    "sparse_allgather_overlap", label="(c') sparse all-gather overlapped (torch DDP)",
    short="sparse all-gather overlapped", aliases=("sparse_overlap",),
    description="nn.Embedding(sparse=True) under torch DDP as fairseq's c10d builds it: the dense buckets and the "
                "untied table's sparse gradient (a bucket of its own, all-gathered by gloo as indices and values) "
                "reduced during the backward; a tied table's gradient is dense, so there it is c10d (simulator "
                "cost: (c)'s)",
    volume=V.sparse_allgather, cost=LazyRef(_COSTS, "sparse_allgather"),
    build=LazyRef(_BUILDERS, "build_sparse_allgather_overlap"),
)
register_strategy(
    "embrace_noschedule", label="(d) EmbRace, no schedule", short="EmbRace no schedule",
    aliases=("embrace_no_schedule", "d"),
    description="EmbRace on DeepSpeed, schedule off: the AlltoAll exchange before the forward, the gradient rows "
                "after the backward, then the dense all-reduce buckets, nothing overlapped",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "noschedule"),
    build=LazyRef(_BUILDERS, "build_embrace_noschedule"), shards_table=True,
)
register_strategy(
    "embrace_fifo", label="(d') EmbRace, FIFO overlap", short="EmbRace FIFO",
    aliases=("fifo",),
    description="EmbRace on DeepSpeed with plain overlap, the schedule's ablation baseline: the dense all-reduce "
                "buckets issued during the backward in the order they become ready, whole (no model-level priority, "
                "no tensor-level pieces)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "fifo"),
    build=LazyRef(_BUILDERS, "build_embrace_fifo"), shards_table=True,
)
register_strategy(
    "embrace_schedule", label="(e) EmbRace, 2D schedule", short="EmbRace schedule", aliases=("embrace", "e"),
    description="EmbRace with the 2D schedule: the same traffic on one priority link, the forward exchange first, "
                "dense pieces during the backward input-near first, urgent gradient rows before deferred ones",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_schedule"), shards_table=True,
)

register_strategy(
    "embrace_auto", label="(e-a) EmbRace, automatic plan (the default)", short="EmbRace auto", aliases=("auto",),
    description="the EmbRace architecture with --embrace-plan auto (the default), planned on the link it runs on from "
                "the rates the start-up probe measures there: where nothing is sharded, the stock modules under "
                "fairseq's c10d as fairseq-train runs them then; else the planned tables under the EmbRace hook on "
                "DeepSpeed with the plan's schedule, buckets and pieces (scaled with the model); the plan is recorded",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "auto"),
    build=LazyRef(_BUILDERS, "build_embrace_auto"), planned=True,
)
register_strategy(
    "embrace_zero1", label="(e-z1) EmbRace on DeepSpeed ZeRO-1", short="EmbRace ZeRO-1", aliases=("ezero1",),
    description="EmbRace's sharded tables and exchange with the dense layers under DeepSpeed ZeRO stage 1 as the "
                "ZeRO baselines run it (overlap_comm, contiguous_gradients, buckets scaled with the model): DeepSpeed reduces the "
                "dense gradients after the backward, each rank steps its 1/N of the dense optimizer state and its "
                "own table rows, the updated dense partitions all-gathered",
    volume=V.embrace_zero_partitioned, cost=LazyRef(_EMBRACE_COSTS, "zero1"),
    build=LazyRef(_BUILDERS, "build_embrace_zero1"), shards_table=True, dense_by_deepspeed=True,
)

register_strategy(
    "embrace_nogate", label="(e-g) EmbRace, 2D schedule without the exchange gate", short="EmbRace no gate",
    aliases=("nogate",),
    description="(e) with \"exchange_gate\": false: dense pieces issued whenever ready, also while an embedding "
                "gradient exchange is in flight (the gate's default now, so the same as (e); simulator cost: (e)'s)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_nogate"), shards_table=True,
)
register_strategy(
    "embrace_gate", label="(e-G) EmbRace, 2D schedule with the exchange gate", short="EmbRace gate",
    aliases=("gate",),
    description="(e) with \"exchange_gate\": true: no dense piece is issued while an embedding gradient exchange "
                "is in flight, although the step waits for every gradient (the gate's ablation; simulator cost: "
                "(e)'s)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_gate"), shards_table=True,
)

register_strategy(
    "embrace_node", label="(e-n) EmbRace, 2D schedule, node-aware exchange", short="EmbRace node-aware",
    aliases=("node",),
    description="(e) with the node-aware exchange: ids merged per node before they cross to other nodes, rows "
                "fanned out and gradient rows summed inside the node (on one rank per node it is (e))",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule_node"),
    build=LazyRef(_BUILDERS, "build_embrace_node"), shards_table=True,
)

register_strategy(
    "embrace_two_level", label="(e-2) EmbRace, 2D schedule, two-level all-reduce", short="EmbRace two-level",
    aliases=("two_level",),
    description="(e) with the dense pieces all-reduced in two levels (inside the node, across on the rails, "
                "inside again) instead of one ring over all ranks (on one rank per node it is (e))",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_two_level"), shards_table=True,
)

register_strategy(
    "embrace_next_forward", label="(e+) EmbRace, 2D schedule + next-forward overlap", short="EmbRace next-forward",
    aliases=("next_forward",),
    description="(e) with cross-iteration overlap: the step does not wait for the dense all-reduce; each layer "
                "is updated when the next forward reaches it (input layers first, as the model level sends them); "
                "the round's last step finishes its updates on the clock (simulator cost: (e)'s)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_next_forward"), shards_table=True,
)

register_strategy(
    "embrace_next_forward_gate", label="(e+G) EmbRace, next-forward overlap with the exchange gate",
    short="EmbRace next-forward gate", aliases=("next_forward_gate",),
    description="(e+) with \"exchange_gate\": true: no dense piece is issued while an embedding gradient exchange "
                "the next forward waits for is in flight (the gate's ablation where it is meant to pay; simulator "
                "cost: (e)'s)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_next_forward_gate"), shards_table=True,
)

register_strategy(
    "embrace_next_forward_whole", label="(e+W) EmbRace, next-forward overlap with whole buckets",
    short="EmbRace next-forward whole", aliases=("next_forward_whole",),
    description="(e+) with \"tensor_level\": false: whole buckets in the model level's order, not 1 MB pieces "
                "(the tensor level's ablation under next-forward overlap: fewer, larger collectives; simulator "
                "cost: (e)'s)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_next_forward_whole"), shards_table=True,
)

register_strategy(
    "embrace_relaxed", label="(e'') EmbRace, 2D schedule + relaxed embedding", short="EmbRace relaxed",
    aliases=("relaxed",),
    description="(e) with the relaxed embedding dependency: the gradient rows the next batch does not read travel "
                "asynchronously and are applied while the next forward runs (the simulator's (e) cost already "
                "models this deferral)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_relaxed"), shards_table=True,
)

register_strategy(
    "embrace_contiguous", label="(e') EmbRace, 2D schedule, contiguous shards", short="EmbRace contiguous",
    aliases=("contiguous",),
    description="(e) with contiguous shards instead of strided ones: rank 0 owns the most frequent words of the "
                "frequency-sorted dictionary, so it serves most rows in forward and receives most gradient rows "
                "in backward (the shard-layout ablation; same bytes in total, unevenly spread)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_contiguous"), shards_table=True,
)

register_strategy(
    "embrace_eager_output_grad", label="(e-d) EmbRace, 2D schedule, output layer's table gradient in its backward",
    short="EmbRace eager output grad", aliases=("eager_output_grad",),
    description="(e) with \"defer_output_grad\": false: a vocab-parallel output layer computes its table's gradient "
                "in its own backward, before the layers below start theirs and their dense all-reduce (the deferral's "
                "ablation; the same as (e) where no step takes the vocab-parallel path)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_eager_output_grad"), shards_table=True,
)

register_strategy(
    "embrace_output_gather", label="(e-og) EmbRace, 2D schedule, output layer gathered",
    short="EmbRace output gather", aliases=("output_gather",),
    description="(e) with --embrace-output gather: a tied output layer reads the whole table, all-gathered each "
                "step, and forms full logits on every rank (the output rule's ablation; the same as (e) where "
                "no output layer reads the sharded table)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_output_gather"), shards_table=True,
)

register_strategy(
    "embrace_output_vocab_parallel", label="(e-ov) EmbRace, 2D schedule, output layer vocab-parallel",
    short="EmbRace output vocab-parallel", aliases=("output_vocab_parallel",),
    description="(e) with --embrace-output vocab-parallel: every step the target hidden states are exchanged and "
                "the softmax combined over the shards, whatever the bytes (the output rule's ablation; the same "
                "as (e) where no output layer reads the sharded table)",
    volume=V.embrace_exchange, cost=LazyRef(_EMBRACE_COSTS, "schedule"),
    build=LazyRef(_BUILDERS, "build_embrace_output_vocab_parallel"), shards_table=True,
)

register_strategy(
    FLOOR, label="(0) compute only, no communication", short="floor", aliases=("floor", "0"),
    description="the physical floor: the stock model stepping the same batches on the same ranks with every "
                "collective skipped (each rank trains its own copy, so its losses drift from the others')",
    volume=V.nothing, cost=LazyRef(_COSTS, "floor"), build=LazyRef(_BUILDERS, "build_compute_floor"),
)

STRATEGIES: Tuple[str, ...] = strategy_names()
