"""Byte accounting of every collective the library issues.

Benchmarks report volume from what was actually sent, not from formulas, so each
exchange records its bytes here. Bytes that stay on the rank (the part of an
AlltoAll a rank sends to itself) are not counted: they never cross a link.

``inter_node`` holds the part of ``sent`` that leaves the rank's node. A collective that
does not say (``inter_node=None``) counts all it sends: one rank per node, the case of a
job that knows nothing of its nodes. The exchanges, which know their topology, say.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

# The kinds of traffic an exchange produces.
COUNTS = "counts"  # per-peer header: how many ids follow (and error flags)
IDS = "ids"  # unique ids sent to their owners
ROWS = "rows"  # embedding rows sent back to the requesters
GRAD_ROWS = "grad_rows"  # gradient rows sent to the owners in backward
TABLE_GATHER = "table_gather"  # full-table all-gather (tied output projection, checkpoints)
TABLE_GRAD = "table_grad"  # reduce-scatter of a full-table gradient
DENSE_GRAD = "dense_grad"  # all-reduce of replicated (dense) parameters
HIDDEN_GATHER = "hidden_gather"  # vocab-parallel output: all-gather of the hidden states
HIDDEN_GRAD = "hidden_grad"  # vocab-parallel output: reduce-scatter of the hidden states' gradients
SOFTMAX_STATS = "softmax_stats"  # vocab-parallel output: counts, targets, per-token statistics
PARAM_GATHER = "param_gather"  # ZeRO: all-gather of the updated parameter partitions (stock baselines)


@dataclass
class CommLedger:
    """Bytes sent and received per kind, and how many collectives were issued."""

    sent: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inter_node: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, kind: str, sent: int, received: int, inter_node: Optional[int] = None) -> None:
        with self._lock:
            self.sent[kind] += int(sent)
            self.received[kind] += int(received)
            self.calls[kind] += 1
            self.inter_node[kind] += int(sent if inter_node is None else inter_node)

    def reset(self) -> None:
        with self._lock:
            self.sent.clear()
            self.received.clear()
            self.calls.clear()
            self.inter_node.clear()

    def total_sent(self, kinds: Optional[Iterable[str]] = None) -> int:
        keys = self.sent.keys() if kinds is None else kinds
        return sum(self.sent.get(k, 0) for k in keys)

    def total_received(self, kinds: Optional[Iterable[str]] = None) -> int:
        keys = self.received.keys() if kinds is None else kinds
        return sum(self.received.get(k, 0) for k in keys)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """A plain-dict copy, safe to json-dump."""
        with self._lock:
            return {
                "sent": dict(self.sent),
                "received": dict(self.received),
                "calls": dict(self.calls),
                "inter_node": dict(self.inter_node),
            }


_GLOBAL = CommLedger()


def global_ledger() -> CommLedger:
    """The process-wide ledger every exchange also records into."""
    return _GLOBAL


def ledgers_for(ledger: Optional[CommLedger]) -> List[CommLedger]:
    """The ledgers an exchange records into: the global one, plus ``ledger`` if given."""
    g = global_ledger()
    return [g] if ledger is None or ledger is g else [g, ledger]


def record_all(ledgers: List[CommLedger], kind: str, sent: int, received: int,
               inter_node: Optional[int] = None) -> None:
    """Record one collective's bytes in every ledger of ``ledgers`` (``inter_node``: the
    part of ``sent`` that leaves the node; ``None``: all of it)."""
    for ledger in ledgers:
        ledger.record(kind, sent, received, inter_node)


def off_rank(counts: List[int], rank: int) -> int:
    """How many of ``counts`` (one per rank) leave this rank: all but its own."""
    return sum(c for r, c in enumerate(counts) if r != rank)
