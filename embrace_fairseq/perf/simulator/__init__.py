"""Step-time cost model of the data-parallel strategies, for any world size and link.

A latency-bandwidth (alpha-beta) network (:mod:`embrace_fairseq.planner.network`): one NIC per rank, ring
collectives, AlltoAll. Compute is per step (forward, backward, optimizer), the
backward split over the dense layers in proportion to their size (:mod:`embrace_fairseq.planner.link`;
the planner prices its per-table plans with the same network, link and byte formulas).
Sparse loads come from unique ids per rank through a Zipf model (:mod:`.sparse_loads`),
and on nodes what a node's ranks ask together (the node-aware exchange merges it).
Each strategy's cost is registered with it (:mod:`embrace_fairseq.perf.strategies`):
the stock ones in :mod:`.allreduce_costs`, EmbRace's in :mod:`.embrace_costs`;
:func:`predict` (:mod:`.predict`) runs the one asked for.

Modules: :mod:`.profile` (what a model costs on one rank; engine options),
:mod:`.prediction` (results), :mod:`.validation` (errors against a bench JSON and a
fit of the network knobs), :mod:`.paper` (8-64 GPU projection of the paper's models),
:mod:`.measure` (a profile measured on this CPU), :mod:`.__main__` (the CLI:
``python -m embrace_fairseq.perf.simulator validate|paper|measure``).
"""
from embrace_fairseq.planner.cost import HEADER_BYTES_PER_PEER
from embrace_fairseq.perf.simulator.measure import fit_zipf_exponent, measure_translation_profile
from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.paper import paper_profiles, paper_study
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.prediction import CostContext, Prediction
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.simulator.sparse_loads import (NodeLoads, SparseLoads, node_loads, sparse_loads,
                                                         zipf_tokens_for_unique)
from embrace_fairseq.perf.simulator.validation import FIT_GRID, fit_network, out_of_sample, runs_and_profiles, validate
from embrace_fairseq.perf.strategies import STRATEGIES, canonical_strategy

__all__ = [
    "CostContext", "FIT_GRID", "HEADER_BYTES_PER_PEER", "Network", "NodeLoads", "Options", "Prediction", "Profile",
    "STRATEGIES", "SparseLoads", "canonical_strategy", "fit_network", "fit_zipf_exponent", "measure_translation_profile",
    "node_loads", "out_of_sample", "paper_profiles", "paper_study", "predict", "runs_and_profiles", "sparse_loads",
    "validate", "zipf_tokens_for_unique",
]
