"""Links calibrated to a regime, and the limit a run's links and cores allow.

A regime (:mod:`embrace_fairseq.perf.simulator.regimes`) fixes the share of a real step
that c10d's all-reduce takes: ``ratio`` = c10d communication / compute-only step of the
released model. The benchmark's small model gets the link that keeps that ratio on this
machine: with its compute-only floor ``floor_s`` measured in the same launch and the bytes
c10d sends per rank per step (:func:`c10d_bytes`: the analytic minimum of
:mod:`embrace_fairseq.perf.bounds`, fp32 as the bench trains), the link moves those bytes
in ``ratio * floor_s``. Both sides count the same way: bytes *sent* per rank per step by a
ring; a ring rank receives as much as it sends, and the emulated link shapes each
direction at the rate, so the sent bytes over the rate are the time. The latency per
message step is scaled by the same factor as compute (measured floor / the real model's).

>>> c = link_for_regime(ratio=0.5, floor_s=0.2, c10d_bytes_per_step=25e6, real_floor_s=0.05, latency_s=10e-6)
>>> c["bytes_per_s"], c["gbit"], c["scale"], round(c["latency_ms"], 6)
(250000000.0, 2.0, 4.0, 0.04)

The limit of a run: no step can be shorter than the compute-only floor, nor than the
least bytes any of the run's strategies must send over the link (EmbRace's minimum):

>>> limit_steps([0.30, 0.20], min_bytes=50e6, gbit=2.0)
[0.3, 0.2]
>>> limit_steps([0.30, 0.20], min_bytes=62.5e6, gbit=2.0)
[0.3, 0.25]

The dependency-aware limit adds what no order of the collectives can change: the dense
gradients of a step exist only once the backward reaches them and must be all-reduced
before the next forward reads them, so the link carries no dense bytes during the
*output stretch* (the output layer's forward, the loss and the output layer's input
gradient, :mod:`.stretch`); a step is at least that stretch plus the dense bytes over the
link:

>>> dependency_limit_steps([0.30, 0.20], stretch_share=0.25, dense_bytes=50e6, min_bytes=55e6, gbit=2.0)
[0.3, 0.25]
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

#: bytes per element the benchmark's gradients take (fp32 on these CPU ranks)
BENCH_ELEMENT_BYTES = 4
#: the floor is warm when two untimed steps in a row agree within this share of the shorter
WARM_TOLERANCE = 0.15
#: untimed floor steps at most before the timed ones (a floor that never settles is timed anyway)
MAX_WARM_STEPS = 6


def is_warm(untimed_steps_s: Sequence[float], tolerance: float = WARM_TOLERANCE) -> bool:
    """Whether the floor's untimed steps have settled (the last two within ``tolerance``).

    One untimed step was not enough: an M2M-100 floor took 4.4 s and then 1.7 s, and the
    median of the two set the link 1.8x too slow for the rounds' 1.7 s floor.

    >>> is_warm([24.0]), is_warm([4.4, 1.7]), is_warm([24.0, 3.9, 3.7])
    (False, False, True)
    """
    if len(untimed_steps_s) < 2:
        return False
    a, b = untimed_steps_s[-2:]
    return abs(a - b) <= tolerance * min(a, b)


def c10d_bytes(world: int, tables: Sequence[Mapping[str, int]], dense_numel: int,
               element_size: int = BENCH_ELEMENT_BYTES) -> float:
    """Bytes c10d sends per rank per step (:func:`embrace_fairseq.perf.bounds.min_bytes_per_step`
    of ``fairseq_c10d``): every table and the dense parameters all-reduced (counted once);
    ``tables``: ``{"vocab", "dim"}`` each. Independent of the ids (sparsity is ignored)."""
    import torch

    from embrace_fairseq.perf.bounds import min_bytes_per_step

    none = [torch.empty(0, dtype=torch.long)] * world
    return float(sum(min_bytes_per_step("fairseq_c10d", world_size=world, vocab=int(t["vocab"]), dim=int(t["dim"]),
                                        dense_numel=dense_numel if i == 0 else 0, ids_per_rank=none,
                                        element_size=element_size)["total"]
                     for i, t in enumerate(tables)))


def link_for_regime(ratio: float, floor_s: float, c10d_bytes_per_step: float, real_floor_s: float,
                    latency_s: float) -> Dict[str, float]:
    """The link that makes c10d's bytes take ``ratio`` of the measured floor step, and the
    regime's latency scaled as compute is (``scale`` = measured floor / real floor)."""
    if ratio <= 0 or floor_s <= 0 or c10d_bytes_per_step <= 0 or real_floor_s <= 0:
        raise ValueError(f"a link needs a positive ratio, floor, byte count and real floor (got {ratio}, {floor_s}, "
                         f"{c10d_bytes_per_step}, {real_floor_s})")
    rate = c10d_bytes_per_step / (ratio * floor_s)
    scale = floor_s / real_floor_s
    return {"bytes_per_s": rate, "gbit": rate * 8 / 1e9, "scale": scale, "latency_ms": 1e3 * latency_s * scale}


def calibrate(workload: str, world: int, floor_steps_s: Sequence[float], tables: Sequence[Mapping[str, int]],
              dense_numel: int, regimes: Sequence[str], latency_applied: bool,
              link_applied: bool = True, warm_steps_s: Sequence[float] = ()) -> List[Dict[str, Any]]:
    """One calibrated link per regime for ``workload`` on ``world`` ranks, from the floor's
    timed steps (their median) and the model's tables and dense size; ``link_applied``:
    false on loopback (the rate is computed and recorded, nothing shapes it); ``warm_steps_s``:
    the untimed steps before them (recorded only)."""
    import statistics

    from embrace_fairseq.perf.simulator.real_models import real_model_of
    from embrace_fairseq.perf.simulator.regimes import get_regime, regime_terms

    floor_s = statistics.median(floor_steps_s)
    sent = c10d_bytes(world, tables, dense_numel)
    real = real_model_of(workload)
    out = []
    for name in regimes:
        regime = get_regime(name)
        terms = regime_terms(real, regime, world)
        link = link_for_regime(terms["ratio"], floor_s, sent, terms["floor_s"], regime.latency_s)
        out.append({
            "regime": regime.name, "regime_spec": regime.as_dict(), "real_model": real.name,
            "real_model_description": real.description, "ratio": terms["ratio"], "real_comm_s": terms["comm_s"],
            "real_floor_s": terms["floor_s"], "floor_s": floor_s, "floor_steps_s": list(floor_steps_s),
            "warm_steps_s": list(warm_steps_s),
            "c10d_bytes_per_rank_per_step": sent, "scale": link["scale"], "bytes_per_s": link["bytes_per_s"],
            "gbit": link["gbit"], "latency_ms": link["latency_ms"], "link_applied": link_applied,
            "latency_applied": latency_applied and link_applied,
        })
    return out


def limit_steps(floor_steps_s: Sequence[float], min_bytes: float, gbit: float) -> List[float]:
    """Per timed step of the floor, the limit: the floor's step or the least bytes over the
    link, whichever is longer."""
    wire = min_bytes / (gbit * 1e9 / 8) if min_bytes and gbit > 0 else 0.0
    return [max(f, wire) for f in floor_steps_s]


def dependency_limit_steps(floor_steps_s: Sequence[float], stretch_share: float, dense_bytes: float,
                           min_bytes: float, gbit: float) -> List[float]:
    """Per timed step of the floor, the dependency-aware limit: the longest of the floor's
    step, the least bytes over the link, and the output stretch (``stretch_share`` of the
    floor's step: the share the stock model's profile measured) plus the dense bytes over
    the link."""
    rate = gbit * 1e9 / 8 if gbit > 0 else float("inf")
    return [max(lim, stretch_share * f + dense_bytes / rate)
            for f, lim in zip(floor_steps_s, limit_steps(floor_steps_s, min_bytes, gbit))]
