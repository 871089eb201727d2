"""Bytes per step and predicted step time of one plan: pure arithmetic.

A plan gives each table one of three choices:

* ``replicate``: the stock path; the table is a plain parameter, its gradient all-reduced
  with the dense gradients in DDP-style buckets while the backward runs. A table looked
  up at the input has its gradient ready last (the input is the end of the backward); an
  untied output projection's is ready first.
* ``row-shard``: each rank holds ``1/N`` of the rows; lookups go through the AlltoAll
  exchange (ids and rows before the forward, gradient rows after the backward). A tied
  output layer reads the sharded table as ``--embrace-output`` says: gathered, or
  vocab-parallel, or (``auto``) the cheaper of the two.
* ``vocab-parallel``: an untied output projection sharded by rows; the hidden states
  travel instead of the table (:func:`~embrace_fairseq.planner.volume.vocab_parallel_output`).

The link is the alpha-beta :class:`~.network.Network` of the simulator, the dense and
replicated gradients run on one non-preemptive link (:func:`~.link.run_link`) as they
become ready, and compute is one measured step split 1 : 2 into forward and backward.
Unique ids per rank are bounded by the lookups (every lookup a distinct id): the
exchange is priced at its largest, which keeps the choice on the safe side of stock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from embrace_fairseq.core.ring_volume import ring_allgather_bytes, ring_allreduce_bytes
from embrace_fairseq.planner import volume as V
from embrace_fairseq.planner.inputs import INPUT, OUTPUT, TIED, PlanInputs, TableInput
from embrace_fairseq.planner.link import Job, run_link
from embrace_fairseq.planner.network import Network

REPLICATE, ROW_SHARD, VOCAB_PARALLEL = "replicate", "row-shard", "vocab-parallel"
CHOICES = (REPLICATE, ROW_SHARD, VOCAB_PARALLEL)

HEADER_BYTES_PER_PEER = 3 * 8  # the exchange header: count, error flag, bad id (int64)
SOFTMAX_STAT_BYTES = 2 * 4  # vocab-parallel output: max and sum per token, fp32
FORWARD_SHARE = 1.0 / 3.0  # forward : backward = 2 : 4 FLOPs per parameter per token
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's (and fairseq's --bucket-cap-mb) default bucket


@dataclass(frozen=True)
class _Traffic:
    """One table under one choice: what it sends and when."""

    forward_s: float = 0.0  # collectives the forward waits for
    backward_s: float = 0.0  # inside the backward (the output layer's, first)
    after_s: float = 0.0  # after the backward, before the step (gradient rows)
    allreduce_numel: int = 0  # all-reduced with the dense gradients
    ready_first: bool = False  # its gradient is ready when the backward starts
    sent_bytes: float = 0.0  # per rank per step


@dataclass(frozen=True)
class _Step:
    """The :class:`~.volume.StepTraffic` of one table, ids bounded by the lookups."""

    world_size: int
    dim: int
    element_size: int
    id_size: int
    tied_output: Optional[str]
    unique: float
    rows: int
    output_tokens: int
    exchanges_per_step: int = 1
    dense_bytes: float = 0.0

    @property
    def table_bytes(self) -> float:
        return float(self.rows * self.dim * self.element_size)

    @property
    def tokens_per_rank(self) -> List[int]:
        return [self.output_tokens] * self.world_size

    @property
    def unique_total(self) -> float:
        return self.unique * self.world_size

    @property
    def off_owner_total(self) -> float:
        return self.unique * (self.world_size - 1)


def network_of(inputs: PlanInputs) -> Network:
    """The link the rates describe: the measured ring rate on every NIC, nodes as given."""
    r = inputs.rates
    return Network(link_gbit=r.link_bytes_per_s * 8 / 1e9, latency_s=r.latency_s,
                   ranks_per_node=inputs.ranks_per_node)


def output_read(inputs: PlanInputs, table: TableInput) -> str:
    """How a sharded output layer reads its table: ``gather`` or ``vocab_parallel``
    (``auto``: the one sending fewer bytes, as the run-time chooser decides)."""
    if inputs.output_mode == "gather" or not table.plain_output:
        return "gather"
    if inputs.output_mode == "vocab-parallel":
        return "vocab_parallel"
    n, e, D = inputs.world_size, inputs.element_size, table.dim
    gather = 2 * ring_allgather_bytes(table.numel * e, n)
    vp = sum(V.vocab_parallel_output(_step(inputs, table, "vocab_parallel")).values())
    return "vocab_parallel" if vp < gather else "gather"


def _step(inputs: PlanInputs, table: TableInput, tied: Optional[str]) -> _Step:
    return _Step(inputs.world_size, table.dim, inputs.element_size, inputs.id_size, tied,
                 float(min(table.lookups_per_rank, table.rows)), table.rows, table.output_tokens_per_rank)


def _output_traffic(net: Network, inputs: PlanInputs, table: TableInput, read: str) -> Tuple[float, float]:
    """(forward, backward) seconds of a sharded output layer."""
    n, e, D, T = inputs.world_size, inputs.element_size, table.dim, table.output_tokens_per_rank
    if read == "gather":
        return net.allgather(n * -(-table.rows // n) * D * e, n), net.reduce_scatter(table.numel * e, n)
    fwd = net.allgather(n * T * D * e, n) + net.allgather(n * T * SOFTMAX_STAT_BYTES, n)
    return fwd, net.reduce_scatter(n * T * D * e, n)


def table_traffic(inputs: PlanInputs, table: TableInput, choice: str, net: Optional[Network] = None) -> _Traffic:
    """What ``table`` sends per step under ``choice``, and when."""
    net = net or network_of(inputs)
    n, e = inputs.world_size, inputs.element_size
    if choice == REPLICATE or n == 1:
        return _Traffic(allreduce_numel=table.numel, ready_first=table.use == OUTPUT,
                        sent_bytes=ring_allreduce_bytes(table.numel * e, n))
    if choice == VOCAB_PARALLEL and table.use == OUTPUT:
        fwd, bwd = _output_traffic(net, inputs, table, "vocab_parallel")
        kinds = V.vocab_parallel_output(_step(inputs, table, "vocab_parallel"))
        return _Traffic(forward_s=fwd, backward_s=bwd, sent_bytes=sum(kinds.values()))
    if choice not in (ROW_SHARD, VOCAB_PARALLEL) or table.use == OUTPUT:
        raise ValueError(f"{table.name}: no choice {choice!r} for a table used as {table.use}")
    read = None
    if table.use == TIED:
        read = "vocab_parallel" if choice == VOCAB_PARALLEL else output_read(inputs, table)
    step = _step(inputs, table, read)
    off = step.unique * (n - 1) / n  # ids this rank asks of other owners (strided: even)
    row = table.dim * e
    ids_s = net.alltoall((n - 1) * HEADER_BYTES_PER_PEER + off * inputs.id_size, n)
    rows_s = net.alltoall(off * row, n)
    out_fwd, out_bwd = _output_traffic(net, inputs, table, read) if read else (0.0, 0.0)
    sent = sum(v for k, v in V.embrace_exchange(step).items())
    if read == "vocab_parallel" and table.output_bias:
        # the bias gradient's rows, all-gathered in the backward (core/tied_projection.py)
        bias = n * -(-table.rows // n) * e
        out_bwd += net.allgather(bias, n)
        sent += ring_allgather_bytes(bias, n)
    return _Traffic(forward_s=ids_s + rows_s + out_fwd, backward_s=out_bwd, after_s=rows_s, sent_bytes=sent)


@dataclass(frozen=True)
class StepCost:
    """One plan's predicted step: seconds, and bytes each rank sends."""

    step_s: float
    compute_s: float
    sent_bytes: float
    table_bytes: Dict[str, float] = field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s


def _allreduce_jobs(net: Network, n: int, segments: Sequence[Tuple[int, float, float]], cap_bytes: int,
                    piece_bytes: Optional[int], e: int) -> List[Job]:
    """Buckets of up to ``cap_bytes`` over the gradients in readiness order; a bucket goes
    when its last byte is ready, whole or (``piece_bytes``) cut into pieces.
    ``segments``: (numel, ready at start, ready at end) in readiness order; a segment's
    bytes become ready evenly between the two times."""
    total = float(sum(numel for numel, _, _ in segments) * e)

    def ready_at(x: float) -> float:
        pos = 0.0
        for numel, t0, t1 in segments:
            size = numel * e
            if x <= pos + size:
                return t0 + (t1 - t0) * (x - pos) / size
            pos += size
        return segments[-1][2]

    jobs: List[Job] = []
    k, start = 0, 0.0
    while start < total:
        end = min(total, start + cap_bytes)
        pieces = [end - start] if not piece_bytes else _cut(end - start, piece_bytes)
        for i, p in enumerate(pieces):
            jobs.append(Job(f"ar{k}.{i}", ready_at(end), net.allreduce(p, n), (1, k, i)))
        k, start = k + 1, end
    return jobs


def _cut(nbytes: float, piece: int) -> List[float]:
    whole, rest = divmod(nbytes, piece)
    return [float(piece)] * int(whole) + ([rest] if rest > 0 else [])


def step_cost(inputs: PlanInputs, choices: Mapping[str, str], schedule: bool = False,
              bucket_bytes: int = DDP_BUCKET_BYTES, piece_bytes: Optional[int] = None) -> StepCost:
    """The predicted step of ``choices`` (table name -> choice). ``schedule``: the dense
    gradients in ``bucket_bytes`` buckets cut into ``piece_bytes`` pieces (the 2D
    schedule); off: whole buckets (DDP). Replicating every table is the stock step."""
    net, n, e = network_of(inputs), inputs.world_size, inputs.element_size
    compute = inputs.rates.compute_s
    fwd, bwd = compute * FORWARD_SHARE, compute * (1 - FORWARD_SHARE)
    traffic = {t.name: table_traffic(inputs, t, choices.get(t.name, REPLICATE), net) for t in inputs.tables}
    fwd_end = fwd + sum(t.forward_s for t in traffic.values())
    bwd_start = fwd_end + sum(t.backward_s for t in traffic.values())  # the output layer's, first
    bwd_end = bwd_start + bwd
    first = sum(t.allreduce_numel for t in traffic.values() if t.ready_first)
    last = sum(t.allreduce_numel for t in traffic.values() if not t.ready_first)
    segments = [(s, a, b) for s, a, b in ((first, bwd_start, bwd_start), (inputs.dense_numel, bwd_start, bwd_end),
                                          (last, bwd_end, bwd_end)) if s > 0]
    jobs = _allreduce_jobs(net, n, segments, bucket_bytes, piece_bytes if schedule else None, e) if n > 1 else []
    after = sum(t.after_s for t in traffic.values())
    if after > 0:
        jobs.append(Job("grad_rows", bwd_end, after, (0,)))  # urgent: the step waits for it
    end = max([bwd_end] + [s[1] for s in run_link(jobs).values()])
    sent = sum(t.sent_bytes for t in traffic.values()) + ring_allreduce_bytes(inputs.dense_numel * e, n)
    return StepCost(end, compute, sent, {k: t.sent_bytes for k, t in traffic.items()})


def stock_cost(inputs: PlanInputs) -> StepCost:
    """Every table replicated, DDP's buckets: the stock step."""
    return step_cost(inputs, {t.name: REPLICATE for t in inputs.tables})
