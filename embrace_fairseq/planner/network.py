"""The alpha-beta network: one full-duplex NIC per rank, ring collectives, AlltoAll.

Every rank has one NIC of ``bw`` bytes/s each way and every message step costs
``alpha`` seconds. A ring all-reduce costs ``2(N-1) alpha`` plus its volume
(:func:`embrace_fairseq.core.ring_volume.ring_allreduce_bytes`) over ``bw``; an
all-gather or reduce-scatter ``(N-1) alpha`` plus half that volume; an AlltoAll
``(N-1) alpha`` plus the busiest rank's larger direction over ``bw``.

Nodes (``ranks_per_node`` K > 1): ``link_gbit`` is then the *node's* NIC, which its K
ranks share, and ranks of one node talk over ``intra_gbit``. A ring in node order crosses
each node's NIC once per direction, so its time is its per-rank volume over the slower of
the two links; an AlltoAll sends ``(N-K)/(N-1)`` of each rank's bytes off the node, K
ranks' worth through one NIC; :meth:`Network.allreduce_two_level` is the all-reduce in
two levels (:func:`embrace_fairseq.core.collectives.all_reduce_two_level`). The node-aware
exchange's hops are :meth:`Network.alltoall_inside` (the ranks of each node) and
:meth:`Network.alltoall_rails` (one rank per node, the node's K rails at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    ranks_per_node: int = 1
    intra_gbit: Optional[float] = None  # between ranks of one node (None: link_gbit)

    def __post_init__(self) -> None:
        if (self.link_gbit <= 0 or self.latency_s < 0 or not 0 < self.efficiency <= 1 or self.overhead_s < 0
                or self.host_s_per_byte < 0 or self.contention < 1 or self.ranks_per_node < 1
                or (self.intra_gbit is not None and self.intra_gbit <= 0)):
            raise ValueError(f"bad network parameters: {self}")

    def per_node(self, n: int) -> int:
        """Ranks per node in a job of ``n`` (1: every rank its own node; ``n``: one node)."""
        k = self.ranks_per_node
        return k if 1 < k <= n and n % k == 0 else 1

    def _rate(self, gbit: float) -> float:
        wire = gbit * 1e9 / 8 * self.efficiency
        if self.host_s_per_byte == 0:
            return wire
        return 1.0 / (1.0 / wire + self.host_s_per_byte * self.contention)

    @property
    def intra_bytes_per_s(self) -> float:
        return self._rate(self.link_gbit if self.intra_gbit is None else self.intra_gbit)

    def _ring_rate(self, n: int) -> float:
        """A ring in node order runs at its slowest edge's rate."""
        k = self.per_node(n)
        if k == 1:
            return self.bytes_per_s
        return self.intra_bytes_per_s if k == n else min(self.bytes_per_s, self.intra_bytes_per_s)

    @property
    def bytes_per_s(self) -> float:
        """Effective bytes per second of ``link_gbit``, slowed by host work per byte."""
        return self._rate(self.link_gbit)

    def allreduce(self, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.overhead_s + 2 * (n - 1) * self.latency_s + ring_allreduce_bytes(nbytes, n) / self._ring_rate(n)

    def allreduce_two_level(self, nbytes: float, n: int) -> float:
        """Reduce-scatter inside each node, all-reduce of the chunks across the nodes (the
        node's K rails share its NIC), all-gather inside; one ring where there are no nodes."""
        k = self.per_node(n)
        if k == 1:
            return self.allreduce(nbytes, n)
        if nbytes <= 0:
            return 0.0
        m = n // k
        inside = 2 * ((k - 1) * self.latency_s + ring_allgather_bytes(nbytes, k) / self.intra_bytes_per_s)
        across = 2 * (m - 1) * self.latency_s + k * ring_allreduce_bytes(nbytes / k, m) / self.bytes_per_s
        return 3 * self.overhead_s + inside + across

    def allgather(self, total_bytes: float, n: int) -> float:
        """Ring all-gather whose blocks add up to ``total_bytes`` (also a reduce-scatter)."""
        if n <= 1 or total_bytes <= 0:
            return 0.0
        return self.overhead_s + (n - 1) * self.latency_s + ring_allgather_bytes(total_bytes, n) / self._ring_rate(n)

    reduce_scatter = allgather

    def alltoall(self, busiest_bytes: float, n: int, nic_bytes: Optional[float] = None) -> float:
        """AlltoAll where the busiest rank sends (or receives) ``busiest_bytes``.

        On nodes, ``nic_bytes`` is what the busiest node's NIC sends (or receives); by
        default K ranks' worth of the busiest rank's share leaving the node, which is right
        when the ranks of a node are as busy as each other and too much when one is busier.
        """
        if n <= 1:
            return 0.0
        k = self.per_node(n)
        if k == 1:
            return self.overhead_s + (n - 1) * self.latency_s + busiest_bytes / self.bytes_per_s
        # spread evenly over the peers: (n-k)/(n-1) leaves the node, k ranks' worth per NIC
        if nic_bytes is None:
            nic_bytes = k * busiest_bytes * (n - k) / (n - 1)
        across = nic_bytes / self.bytes_per_s
        inside = busiest_bytes * (k - 1) / (n - 1) / self.intra_bytes_per_s
        return self.overhead_s + (n - 1) * self.latency_s + max(across, inside)

    def alltoall_inside(self, busiest_bytes: float, n: int) -> float:
        """An AlltoAll among the ranks of each node at once, over the link inside the node
        (0 where a rank is its own node: there is nobody to send to)."""
        k = self.per_node(n)
        if k == 1:
            return 0.0
        return self.overhead_s + (k - 1) * self.latency_s + busiest_bytes / self.intra_bytes_per_s

    def alltoall_rails(self, busiest_bytes: float, n: int, nic_bytes: Optional[float] = None) -> float:
        """An AlltoAll along every rail at once (the ranks of one local index, one per node):
        the node's K rails share its NIC, which carries ``nic_bytes`` (by default K ranks'
        worth of ``busiest_bytes``). Without nodes the one rail is the whole job: :meth:`alltoall`."""
        k = self.per_node(n)
        if k == 1:
            return self.alltoall(busiest_bytes, n)
        m = n // k
        if m == 1:
            return 0.0
        if nic_bytes is None:
            nic_bytes = k * busiest_bytes
        return self.overhead_s + (m - 1) * self.latency_s + nic_bytes / self.bytes_per_s
