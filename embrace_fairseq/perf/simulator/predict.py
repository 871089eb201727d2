"""Steady-state step time of a registered strategy on ``N`` ranks (:func:`predict`).

Compute is per step (forward, backward, optimizer); the communication and what it
overlaps is the strategy's registered cost (:mod:`embrace_fairseq.perf.strategies`).
"""
from __future__ import annotations

from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.prediction import CostContext, Prediction
from embrace_fairseq.perf.simulator.profile import Options, Profile
from embrace_fairseq.perf.strategies import get_strategy


def predict(profile: Profile, strategy: str, world_size: int, net: Network, opts: Options = Options(),
            compute_scale: float = 1.0) -> Prediction:
    """Steady-state step time of ``strategy`` (a name or an alias) on ``world_size`` ranks.

    ``compute_scale`` multiplies the profile's compute (ranks sharing CPU cores)."""
    spec = get_strategy(strategy)
    n = world_size
    F, B, O = (compute_scale * t for t in (profile.forward_s, profile.backward_s, profile.optimizer_s))
    if spec.shards_table and n > 1:
        # each rank steps only its shard of the table (the profile times the full model)
        full = profile.dense_numel + profile.vocab * profile.dim
        O *= (profile.dense_numel + -(-profile.vocab // n) * profile.dim) / full
    ctx = CostContext(profile, spec.name, n, net, opts, F, B, O)
    if n <= 1:
        return ctx.prediction(ctx.compute_s, 0.0, 0.0)
    return spec.cost(ctx)
