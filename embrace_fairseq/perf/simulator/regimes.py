"""Compute-matched regimes: a GPU and its network, as the share of a step c10d communicates.

A regime is a GPU's sustained compute and memory rates and its per-GPU network
(:class:`Regime`). On a released model (:mod:`.real_models`) it fixes one number, the
ratio of c10d's communication time to the compute-only step (:func:`c10d_comm_ratio`):
the simulator's c10d all-reduce of every gradient (25 MB buckets, ring, ``wire_bytes``
per element, ``2(N-1)`` message steps of ``latency_s`` each per bucket; the link's busy
time, :func:`.allreduce_costs.c10d`'s ``comm_s``) over the simulator's compute-only floor
(forward + backward + optimizer at the regime's rates). The benchmark sets its emulated
link so that the same ratio holds for its small model on this CPU
(``python -m embrace_fairseq.perf.bench --regime ...``).

By hand, a model of one bucket (``T`` bytes of gradients) on ``N`` ranks:
``comm = 2(N-1) latency + 2(N-1)/N T / bw``:

>>> tiny = Regime("tiny", sustained_flops=1e12, memory_bytes_per_s=1e9, gbit_per_gpu=8.0, latency_s=1e-6)
>>> from embrace_fairseq.perf.simulator.profile import Profile
>>> p = Profile("p", vocab=1000, dim=10, dense_layers=[("d", 1000)], tokens_per_rank=1, forward_s=0.001,
...             backward_s=0.002, optimizer_s=0.0, element_size=2)
>>> t = regime_terms(p, tiny, 4)
>>> round(t["comm_s"], 9), round(2 * 3 * 1e-6 + 1.5 * 22000 / 1e9, 9), round(t["floor_s"], 6)
(3.9e-05, 3.9e-05, 0.003)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Union

from embrace_fairseq.planner.network import Network
from embrace_fairseq.perf.simulator.paper import PAPER_LATENCY_S
from embrace_fairseq.perf.simulator.predict import predict
from embrace_fairseq.perf.simulator.profile import Profile
from embrace_fairseq.perf.simulator.real_models import REAL_MODELS, RealModel
from embrace_fairseq.perf.strategies import FLOOR

C10D = "fairseq_c10d"


@dataclass(frozen=True)
class Regime:
    """One GPU's rates and its network: ``sustained_flops`` in mixed precision,
    ``memory_bytes_per_s`` for the optimizer step, ``gbit_per_gpu`` each way, ``latency_s``
    per message step, ``wire_bytes`` per gradient element and row (2: fp16)."""

    name: str
    sustained_flops: float
    memory_bytes_per_s: float
    gbit_per_gpu: float
    latency_s: float
    wire_bytes: int = 2

    def network(self) -> Network:
        return Network(self.gbit_per_gpu, latency_s=self.latency_s)

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


REGIMES: Dict[str, Regime] = {r.name: r for r in (
    # V100 (HBM2 ~900 GB/s) sustaining 30 TFLOP/s mixed precision, a 25 Gbit/s NIC per GPU
    Regime("v100-25g", 30e12, 900e9, 25.0, PAPER_LATENCY_S),
    # A100 (HBM2e ~1.5 TB/s) sustaining 120 TFLOP/s, 100 Gbit/s per GPU
    Regime("a100-100g", 120e12, 1.5e12, 100.0, PAPER_LATENCY_S),
)}


def get_regime(name: Union[str, Regime]) -> Regime:
    """The regime of ``name``; ``ValueError`` naming the known ones."""
    if isinstance(name, Regime):
        return name
    try:
        return REGIMES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown regime {name!r}; expected one of {', '.join(REGIMES)}") from None


def _profile(model: Union[str, RealModel, Profile], regime: Regime) -> Profile:
    if isinstance(model, Profile):
        return model
    if isinstance(model, str):
        try:
            model = REAL_MODELS[model]
        except KeyError:
            raise ValueError(f"unknown real model {model!r}; expected one of {', '.join(REAL_MODELS)}") from None
    return model.profile(regime)


def regime_terms(real_model: Union[str, RealModel, Profile], regime: Union[str, Regime],
                 world: int) -> Dict[str, float]:
    """c10d's communication seconds per step (the link's busy time), the compute-only
    floor's step and their ratio, for ``real_model`` (a name, a :class:`RealModel` or a
    profile taken as it is) on ``world`` GPUs of ``regime``."""
    regime = get_regime(regime)
    prof = _profile(real_model, regime)
    net = regime.network()
    comm = predict(prof, C10D, world, net).comm_s
    floor = predict(prof, FLOOR, world, net).step_s
    return {"comm_s": comm, "floor_s": floor, "ratio": comm / floor}


def c10d_comm_ratio(real_model: Union[str, RealModel, Profile], regime: Union[str, Regime], world: int) -> float:
    """c10d's communication time over the compute-only step (:func:`regime_terms`)."""
    return regime_terms(real_model, regime, world)["ratio"]
