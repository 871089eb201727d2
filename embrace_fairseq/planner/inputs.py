"""What a plan is decided from: the model's tables and dense bytes, the step, the ranks
and the measured rates.

Every field is agreed on every rank before a plan is chosen (the rates are the slowest
rank's, :mod:`.probe`), so every rank computes the same plan from the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from embrace_fairseq.core.errors import UserError

#: how a table is used: looked up only, looked up and read by the tied output layer, or
#: an untied output projection (read by the output layer only)
INPUT, TIED, OUTPUT = "input", "tied", "output"
USES = (INPUT, TIED, OUTPUT)


class PlanInputError(UserError, ValueError):
    """Inputs the planner cannot price (a size or rate that is not positive)."""


@dataclass(frozen=True)
class TableInput:
    """One table: ``name`` (its module path, e.g. ``decoder.embed_tokens``), ``rows`` x ``dim``.

    lookups_per_rank: ids looked up in it per rank per step (both sides of a translation
        model when encoder and decoder share it); 0 for an output projection.
    output_tokens_per_rank: tokens the output layer reads it for per rank per step (0
        when it is not an output).
    plain_output: the output layer is a plain ``V x D`` projection (not an adaptive
        softmax): only then can it run vocab-parallel.
    output_bias: the tied output layer adds a replicated ``V``-sized bias (RoBERTa's LM
        head): read vocab-parallel, its gradient's rows are all-gathered in the backward.
    """

    name: str
    rows: int
    dim: int
    use: str
    lookups_per_rank: int = 0
    output_tokens_per_rank: int = 0
    plain_output: bool = True
    output_bias: bool = False

    def __post_init__(self) -> None:
        if self.use not in USES:
            raise PlanInputError(f"table {self.name}: use must be one of {USES}, got {self.use!r}")
        if self.rows < 1 or self.dim < 1:
            raise PlanInputError(f"table {self.name}: {self.rows} x {self.dim} is not a table")

    @property
    def numel(self) -> int:
        return self.rows * self.dim

    @property
    def is_output(self) -> bool:
        return self.use in (TIED, OUTPUT)


@dataclass(frozen=True)
class Rates:
    """The link and the compute, measured on the ranks (:mod:`.probe`).

    link_bytes_per_s: the all-reduce ring's rate in wire bytes per second per rank.
    latency_s: per message step of a collective.
    compute_s: one training step's forward and backward on one rank, communication aside.
    compute_from: ``step`` (a timed step of the stock model) or ``flops`` (a matrix
        product's FLOP rate).
    """

    link_bytes_per_s: float
    latency_s: float
    compute_s: float
    compute_from: str = "flops"

    def __post_init__(self) -> None:
        if not (self.link_bytes_per_s > 0 and self.latency_s >= 0 and self.compute_s >= 0):
            raise PlanInputError(f"rates must be positive: {self}")


@dataclass(frozen=True)
class PlanInputs:
    """Everything the cost model reads.

    dense_numel: elements of the replicated parameters other than the tables.
    output_mode: how a sharded output layer reads its table (``--embrace-output``:
        ``auto`` the cheaper per step, ``gather`` or ``vocab-parallel``).
    """

    tables: Tuple[TableInput, ...]
    dense_numel: int
    world_size: int
    ranks_per_node: int
    rates: Rates
    element_size: int = 4
    id_size: int = 8
    output_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise PlanInputError(f"world size {self.world_size}, {self.ranks_per_node} ranks per node")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise PlanInputError(f"table names repeat: {names}")

    def table(self, name: str) -> TableInput:
        return next(t for t in self.tables if t.name == name)
