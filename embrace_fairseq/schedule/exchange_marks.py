"""What the schedule sets on each sharded table: trace marks of its exchanges and the
exchange gate around its gradient exchange. Shared by both training engines' adapters."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.trace import Tracer, TracingLedger
from embrace_fairseq.schedule.gate import ExchangeGate, gate_scope


def trace_tables(tables: Sequence[ShardedEmbedding], tracer: Tracer) -> None:
    """Tracing on: each table records its exchanges into a :class:`TracingLedger` (a
    forward exchange and a table gather mark their own start; the backward exchange:
    :func:`scope_grad_exchanges`)."""
    if not tracer.enabled:
        return
    for emb in tables:
        emb.ledger = TracingLedger(tracer, inner=emb.ledger)


def scope_grad_exchanges(tables: Sequence[ShardedEmbedding], gate: Optional[ExchangeGate],
                         active: Callable[[], bool]) -> None:
    """Around each gradient exchange of a table's looked-up rows -- once per exchange,
    whatever number of outputs the lookup served (encoder and decoder tokens of a shared
    table are one exchange) or of lookups the shard gradient sums: the trace marks its
    start, and in a reducing backward (``active()``) the exchange gate is closed for it
    (entered when it begins, left when it ended). Call after :func:`trace_tables`."""
    for emb in tables:
        ledger = emb.ledger if isinstance(emb.ledger, TracingLedger) else None
        if not emb.is_sharded or (gate is None and ledger is None):
            continue
        emb.set_grad_exchange_scope(gate_scope(gate, active, ledger.mark if ledger else None))
