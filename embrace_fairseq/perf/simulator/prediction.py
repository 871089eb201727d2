"""What a prediction holds, and what a strategy's cost function is given."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional

from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.simulator.sparse_loads import NodeLoads, SparseLoads


@dataclass
class Prediction:
    strategy: str
    world_size: int
    step_s: float
    compute_s: float
    comm_s: float  # link busy time per step
    exposed_comm_s: float  # step time beyond compute
    detail: Dict[str, float] = field(default_factory=dict)

    @property
    def hidden_share(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 1.0


@dataclass
class CostContext:
    """One strategy on ``world_size`` > 1 ranks: the profile, the link, the compute times
    (already scaled, the optimizer already cut to a shard for sharding strategies)."""

    profile: Profile
    strategy: str
    world_size: int
    net: Network
    opts: Options
    forward_s: float
    backward_s: float
    optimizer_s: float

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def dense_numels(self) -> List[int]:
        return [numel for _, numel in self.profile.dense_layers]

    @property
    def table_numel(self) -> int:
        return self.profile.vocab * self.profile.dim

    @cached_property
    def loads(self) -> SparseLoads:
        return self.profile.loads(self.world_size, self.opts.shard_layout)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node in this job (1: every rank its own node, the world: one node)."""
        return self.net.per_node(self.world_size)

    @cached_property
    def node_loads(self) -> NodeLoads:
        return self.profile.node_loads(self.world_size, self.ranks_per_node, self.opts.shard_layout)

    def prediction(self, step_s: float, comm_s: float, exposed_s: float,
                   detail: Optional[Dict[str, float]] = None) -> Prediction:
        return Prediction(self.strategy, self.world_size, step_s, self.compute_s, comm_s, exposed_s, detail or {})

    def not_overlapped(self, comm_s: float, detail: Dict[str, float]) -> Prediction:
        """Communication after the compute, nothing hidden."""
        return self.prediction(self.compute_s + comm_s, comm_s, comm_s, detail)
