"""The simulator's view of the step's link: the model's dense layers as tensors.

The link itself (jobs, buckets, readiness times) is the planner's
(:mod:`embrace_fairseq.planner.link`).
"""
from __future__ import annotations

from typing import List

from embrace_fairseq.perf.simulator.profile import Profile
from embrace_fairseq.schedule.plan import TensorSpec


def dense_specs(profile: Profile, extra_output: bool) -> List[TensorSpec]:
    """The replicated layers in forward order (and the tied output projection)."""
    specs = [TensorSpec(n, numel, profile.element_size, i) for i, (n, numel) in enumerate(profile.dense_layers)]
    if extra_output:  # the tied output projection: farthest from the input, its gradient ready first
        specs.append(TensorSpec("output_projection", profile.vocab * profile.dim, profile.element_size, len(specs)))
    return specs
