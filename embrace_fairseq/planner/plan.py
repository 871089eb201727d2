"""The per-table plan: which choices each table has, the cheapest combination, an
explicit plan checked, and the start-up lines that say what was chosen.

``auto`` enumerates every combination of the tables' choices with the schedule on
(each bucket and piece size of :data:`SCHEDULE_SIZES`) and off, prices each with
:func:`~.cost.step_cost` and keeps the cheapest; ties go to the earlier candidate, and
replicating every table with the schedule off (the stock step) is the first; a sharded
plan predicted less than :data:`SHARD_MARGIN` faster than stock gives way to it. So the
chosen plan is never predicted slower than stock, and every rank, holding the same
inputs, chooses the same plan. ``shard`` is every table sharded as the ``--embrace-*``
flags say (the behaviour before plans existed); ``replicate`` every table replicated.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.planner.cost import (CHOICES, DDP_BUCKET_BYTES, REPLICATE, ROW_SHARD, VOCAB_PARALLEL,
                                          StepCost, step_cost, stock_cost)
from embrace_fairseq.planner.inputs import OUTPUT, PlanInputs, TableInput

AUTO, SHARD = "auto", "shard"
PLAN_MODES = (AUTO, SHARD, REPLICATE)
#: environment variable: the plan when none is given (``auto`` when unset)
PLAN_ENV = "EMBRACE_PLAN"
#: a sharded plan must be predicted this much faster than stock to be chosen: the cost
#: model leaves out the exchange's own compute (id deduplication, index copies), which
#: sharding adds and replication does not
SHARD_MARGIN = 0.05
#: (bucket, piece) sizes the schedule is priced with
SCHEDULE_SIZES: Tuple[Tuple[int, int], ...] = ((4 << 20, 1 << 20), (4 << 20, 4 << 20), (25 << 20, 4 << 20))


def _size(nbytes: float) -> str:
    """Bytes as the log says them: MB, or kB below a tenth of one."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


class PlanError(UserError, ValueError):
    """A plan that cannot be parsed, names no table, or cannot hold for a table."""


def choices_for(table: TableInput, output_mode: str = "auto") -> Tuple[str, ...]:
    """The choices a table has: a looked-up table replicate or row-shard; an untied output
    projection replicate or vocab-parallel (a plain projection only, and not under
    ``--embrace-output gather``, which keeps it replicated)."""
    if table.use != OUTPUT:
        return (REPLICATE, ROW_SHARD)
    if table.plain_output and output_mode != "gather":
        return (REPLICATE, VOCAB_PARALLEL)
    return (REPLICATE,)


def _why_not(table: TableInput, choice: str, output_mode: str) -> str:
    if table.use == OUTPUT and not table.plain_output:
        return "its output layer is not a plain projection (adaptive softmax), so it cannot run vocab-parallel"
    if table.use == OUTPUT and output_mode == "gather":
        return "--embrace-output gather keeps an untied output projection replicated"
    if table.use == OUTPUT:
        return "an untied output projection is replicated or vocab-parallel"
    return "a looked-up table is replicated or row-sharded (its tied output layer follows --embrace-output)"


@dataclass(frozen=True)
class Plan:
    """One choice per table, the schedule and its sizes, and what they are predicted to cost."""

    choices: Tuple[Tuple[str, str], ...]
    schedule: bool
    bucket_bytes: int
    piece_bytes: Optional[int]
    predicted: StepCost
    stock: StepCost
    how: str  # auto, shard, replicate or explicit
    #: what it was decided from (the rates included), for the record
    inputs: Optional[PlanInputs] = field(default=None, compare=False, repr=False)
    #: seconds the start-up spent planning (the probe included; None: not timed)
    planning_s: Optional[float] = field(default=None, compare=False)

    def choice(self, name: str) -> str:
        return dict(self.choices)[name]

    @property
    def sharded(self) -> bool:
        return any(c != REPLICATE for _, c in self.choices)

    @property
    def speedup(self) -> float:
        return self.stock.step_s / self.predicted.step_s if self.predicted.step_s > 0 else 1.0

    def spec(self) -> str:
        """The plan as ``--embrace-plan`` takes it."""
        return ",".join(f"{name}={choice}" for name, choice in self.choices)

    def record(self) -> Dict[str, Any]:
        """The plan as a results file keeps it: the choices, the schedule, the predicted and
        the stock step and bytes, and the inputs they came from."""
        out: Dict[str, Any] = {
            "how": self.how, "spec": self.spec(), "schedule": self.schedule, "bucket_bytes": self.bucket_bytes,
            "piece_bytes": self.piece_bytes, "predicted_step_s": self.predicted.step_s,
            "stock_step_s": self.stock.step_s, "predicted_speedup": self.speedup,
            "sent_bytes": self.predicted.sent_bytes, "stock_sent_bytes": self.stock.sent_bytes,
            "planning_s": self.planning_s}
        if self.inputs is not None:
            out["inputs"] = asdict(self.inputs)
        return out

    def lines(self, inputs: Optional[PlanInputs] = None) -> List[str]:
        """One start-up line per table and one for the whole."""
        inputs = inputs or self.inputs
        if inputs is None:
            raise ValueError("a plan's lines need the inputs it was decided from")
        out = []
        for name, choice in self.choices:
            t = inputs.table(name)
            mine, stock = self.predicted.table_bytes.get(name, 0.0), self.stock.table_bytes.get(name, 0.0)
            out.append(f"EmbRace plan: {name} {t.rows:,} x {t.dim}: {choice}, {_size(mine)} per step "
                       f"instead of {_size(stock)}")
        sched = (f"schedule on ({self.bucket_bytes >> 20} MiB buckets, {(self.piece_bytes or 0) >> 20} MiB pieces)"
                 if self.schedule else "schedule off")
        out.append(f"EmbRace plan ({self.how}, {inputs.world_size} ranks): {sched}; {_size(self.predicted.sent_bytes)}"
                   f" per step instead of {_size(self.stock.sent_bytes)}; predicted step "
                   f"{self.predicted.step_s * 1e3:.1f} ms against stock {self.stock.step_s * 1e3:.1f} ms, "
                   f"{self.speedup:.2f}x, of which compute {inputs.rates.compute_s * 1e3:.1f} ms ("
                   + ("a timed step of the stock model" if inputs.rates.compute_from == "step"
                      else "priced from a matrix product") + ")"
                   + (f"; planned in {self.planning_s:.2f} s" if self.planning_s else ""))
        return out


def _priced(inputs: PlanInputs, choices: Dict[str, str], schedule: bool, sizes: Tuple[int, Optional[int]],
            stock: StepCost, how: str) -> Plan:
    bucket, piece = sizes
    cost = step_cost(inputs, choices, schedule, bucket, piece)
    return Plan(tuple((t.name, choices[t.name]) for t in inputs.tables), schedule, bucket, piece, cost, stock, how,
                inputs)


def _candidates(inputs: PlanInputs, combos: Sequence[Dict[str, str]], stock: StepCost, how: str,
                schedule: bool = True) -> List[Plan]:
    out = []
    for choices in combos:
        sharded = any(c != REPLICATE for c in choices.values())
        out.append(_priced(inputs, choices, False, (DDP_BUCKET_BYTES, None), stock, how))
        if sharded and schedule:  # the schedule runs where something is sharded (and is not turned off)
            out += [_priced(inputs, choices, True, sizes, stock, how) for sizes in SCHEDULE_SIZES]
    return out


def choose(inputs: PlanInputs, schedule: bool = True) -> Plan:
    """The cheapest plan; replicate-all (the stock step) wins ties and a world of one.
    ``schedule`` False (``--embrace-schedule off``): only plans with the schedule off."""
    stock = stock_cost(inputs)
    replicate_all = {t.name: REPLICATE for t in inputs.tables}
    if inputs.world_size == 1:
        return _priced(inputs, replicate_all, False, (DDP_BUCKET_BYTES, None), stock, AUTO)
    per_table = [choices_for(t, inputs.output_mode) for t in inputs.tables]
    combos = [dict(zip([t.name for t in inputs.tables], c)) for c in itertools.product(*per_table)]
    plans = _candidates(inputs, combos, stock, AUTO, schedule)  # product order: replicate-all first
    best = min(plans, key=lambda p: p.predicted.step_s)  # min keeps the first of equals
    if best.sharded and best.predicted.step_s * (1 + SHARD_MARGIN) > stock.step_s:
        return plans[0]  # a gain inside the model's error: the stock step
    return best


def parse_spec(spec: str) -> Dict[str, str]:
    """``table=choice,...`` -> {table: choice}."""
    out: Dict[str, str] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise PlanError(f"--embrace-plan: {item!r} is not table=choice (or give one of {', '.join(PLAN_MODES)})")
        name, choice = (x.strip() for x in item.split("=", 1))
        if choice not in CHOICES:
            raise PlanError(f"--embrace-plan: {name}={choice}: the choice must be one of {', '.join(CHOICES)}")
        out[name] = choice
    if not out:
        raise PlanError("--embrace-plan is empty")
    return out


def _matches(name: str, key: str) -> bool:
    return name == key or name.endswith("." + key)


def explicit_choices(inputs: PlanInputs, spec: str) -> Dict[str, str]:
    """The choice of every table under ``spec`` (``shard``, ``replicate`` or
    ``table=choice,...``, where ``table`` is a table's name or its last parts, e.g.
    ``embed_tokens`` for both ``encoder.embed_tokens`` and ``decoder.embed_tokens``; tables
    not named are replicated). A choice a table cannot take stops with the reason."""
    if spec == REPLICATE:
        return {t.name: REPLICATE for t in inputs.tables}
    if spec == SHARD:
        return {t.name: choices_for(t, inputs.output_mode)[-1] for t in inputs.tables}
    wanted = parse_spec(spec)
    out = {t.name: REPLICATE for t in inputs.tables}
    for key, choice in wanted.items():
        hit = [t for t in inputs.tables if _matches(t.name, key)]
        if not hit:
            raise PlanError(f"--embrace-plan: no table {key!r}; this model's tables are "
                            + ", ".join(t.name for t in inputs.tables))
        for t in hit:
            if choice not in choices_for(t, inputs.output_mode):
                raise PlanError(f"--embrace-plan: {t.name}={choice} cannot hold: {_why_not(t, choice, inputs.output_mode)}")
            out[t.name] = choice
    return out


def explicit(inputs: PlanInputs, spec: str, schedule: bool = True) -> Plan:
    """``spec``'s plan, priced (the schedule as ``--embrace-schedule`` says, default sizes)."""
    choices = explicit_choices(inputs, spec)
    stock = stock_cost(inputs)
    sharded = any(c != REPLICATE for c in choices.values()) and inputs.world_size > 1
    sizes = SCHEDULE_SIZES[0] if schedule and sharded else (DDP_BUCKET_BYTES, None)
    how = spec if spec in (SHARD, REPLICATE) else "explicit"
    return _priced(inputs, choices, schedule and sharded, sizes, stock, how)


def resolve(inputs: PlanInputs, spec: Optional[str], schedule: bool = True) -> Plan:
    """``auto`` (or None): :func:`choose` (``schedule`` False keeps the schedule off; True
    lets the plan decide); anything else: :func:`explicit`."""
    spec = (spec or AUTO).strip()
    return choose(inputs, schedule) if spec == AUTO else explicit(inputs, spec, schedule)
