"""The alpha-beta network: one full-duplex NIC per rank, ring collectives, AlltoAll.

Every rank has one NIC of ``bw`` bytes/s each way and every message step costs
``alpha`` seconds. A ring all-reduce costs ``2(N-1) alpha`` plus its volume
(:func:`embrace_fairseq.core.ring_volume.ring_allreduce_bytes`) over ``bw``; an
all-gather or reduce-scatter ``(N-1) alpha`` plus half that volume; an AlltoAll
``(N-1) alpha`` plus the busiest rank's larger direction over ``bw``.
"""
from __future__ import annotations

from dataclasses import dataclass

from embrace_fairseq.core.ring_volume import ring_allgather_bytes, ring_allreduce_bytes


@dataclass(frozen=True)
class Network:
    """Per-rank NIC: ``link_gbit`` Gbit/s each way, ``latency_s`` per message step.

    ``efficiency`` is the share of the line rate a collective achieves (protocol
    headers, flow control); ``overhead_s`` is a fixed software cost per collective.
    ``host_s_per_byte`` is the CPU time a rank spends per byte it sends (copies,
    reductions, the TCP stack), times ``contention`` when ranks share cores: it matters
    when ranks are emulated on one machine, and is 0 on a real cluster's GPUs.
    """

    link_gbit: float
    latency_s: float = 10e-6
    efficiency: float = 1.0
    overhead_s: float = 0.0
    host_s_per_byte: float = 0.0
    contention: float = 1.0

    def __post_init__(self) -> None:
        if (self.link_gbit <= 0 or self.latency_s < 0 or not 0 < self.efficiency <= 1 or self.overhead_s < 0
                or self.host_s_per_byte < 0 or self.contention < 1):
            raise ValueError(f"bad network parameters: {self}")

    @property
    def bytes_per_s(self) -> float:
        """Effective bytes per second a rank moves: the link, slowed by host work per byte."""
        wire = self.link_gbit * 1e9 / 8 * self.efficiency
        if self.host_s_per_byte == 0:
            return wire
        return 1.0 / (1.0 / wire + self.host_s_per_byte * self.contention)

    def allreduce(self, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.overhead_s + 2 * (n - 1) * self.latency_s + ring_allreduce_bytes(nbytes, n) / self.bytes_per_s

    def allgather(self, total_bytes: float, n: int) -> float:
        """Ring all-gather whose blocks add up to ``total_bytes`` (also a reduce-scatter)."""
        if n <= 1 or total_bytes <= 0:
            return 0.0
        return self.overhead_s + (n - 1) * self.latency_s + ring_allgather_bytes(total_bytes, n) / self.bytes_per_s

    reduce_scatter = allgather

    def alltoall(self, busiest_bytes: float, n: int) -> float:
        """AlltoAll where the busiest rank sends (or receives) ``busiest_bytes``."""
        if n <= 1:
            return 0.0
        return self.overhead_s + (n - 1) * self.latency_s + busiest_bytes / self.bytes_per_s
