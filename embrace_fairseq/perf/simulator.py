"""Step-time cost model of the data-parallel strategies, for any world size and link.

A latency-bandwidth (alpha-beta) network: every rank has one NIC of ``bw`` bytes/s
(full duplex) and every message step costs ``alpha`` seconds. Collectives are ring
algorithms (all-reduce ``2(N-1) alpha + 2(N-1)/N M/bw``, all-gather and
reduce-scatter half of that), an AlltoAll costs ``(N-1) alpha`` plus the busiest
rank's larger direction over ``bw``. Compute is per step (forward, backward,
optimizer), the backward split over the dense layers in proportion to their size.

Strategies (names as in :mod:`embrace_fairseq.perf.bounds`):

* ``fairseq_legacy_ddp``: backward, then all-reduce of every gradient (table
  included) in flat buffers of up to 2**28 elements, then the optimizer;
* ``fairseq_c10d``: torch DDP, 25 MB buckets all-reduced in readiness order while
  the backward runs (the input table is ready last);
* ``deepspeed``: ZeRO-0, one all-reduce after the backward, no overlap;
* ``sparse_allgather``: as ``deepspeed`` for dense gradients, then the coalesced
  sparse table gradient all-gathered (sizes, int64 indices, values, each rank's block
  padded to the largest, as DeepSpeed does);
* ``embrace_noschedule``: the AlltoAll exchange before the forward, the gradient rows
  AlltoAll after the backward, then the dense all-reduce buckets, nothing overlapped;
* ``embrace_schedule``: the same traffic on one priority link: the forward exchange
  first; dense pieces issued during the backward, input-near layers first; gradient
  rows the next batch reads are urgent, the others are deferred into the next forward.

Sparse loads come from the unique ids per rank: measured counts are matched by a
Zipf model of the (frequency-sorted) vocabulary, which also gives what a contiguous
shard plan implies, i.e. that the rank owning the head of the vocabulary serves far more
rows than the others, and the share of gradient rows the next batch reads.

CLI: ``python -m embrace_fairseq.perf.simulator validate results/bench/quick/bench.json``
(prediction error against measured runs) and ``python -m embrace_fairseq.perf.simulator
paper --out results/simulator/`` (8 to 64 GPUs for the paper's models).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from embrace_fairseq.schedule.plan import TensorSpec, cut_pieces, make_buckets, readiness_order

from embrace_fairseq.perf.bounds import STRATEGIES  # one list of strategy names for bounds and the cost model
# names the benchmark or a user may use for the same strategies
ALIASES = {
    "legacy_ddp": "fairseq_legacy_ddp",
    "fairseq": "fairseq_legacy_ddp",
    "fairseq_stock": "fairseq_legacy_ddp",
    "c10d": "fairseq_c10d",
    "deepspeed_stock": "deepspeed",
    "zero0": "deepspeed",
    "sparse": "sparse_allgather",
    "embrace_no_schedule": "embrace_noschedule",
    "embrace": "embrace_schedule",
    "a": "fairseq_legacy_ddp",
    "b": "deepspeed",
    "c": "sparse_allgather",
    "d": "embrace_noschedule",
    "e": "embrace_schedule",
}
HEADER_BYTES_PER_PEER = 3 * 8  # the exchange header: count, error flag, bad id (int64)


def canonical_strategy(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    return key


# ---------------------------------------------------------------------------- network


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
        return self.overhead_s + 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * nbytes / self.bytes_per_s

    def allgather(self, total_bytes: float, n: int) -> float:
        """Ring all-gather whose blocks add up to ``total_bytes`` (also a reduce-scatter)."""
        if n <= 1 or total_bytes <= 0:
            return 0.0
        return self.overhead_s + (n - 1) * self.latency_s + (n - 1) / n * total_bytes / self.bytes_per_s

    reduce_scatter = allgather

    def alltoall(self, busiest_bytes: float, n: int) -> float:
        """AlltoAll where the busiest rank sends (or receives) ``busiest_bytes``."""
        if n <= 1:
            return 0.0
        return self.overhead_s + (n - 1) * self.latency_s + busiest_bytes / self.bytes_per_s


# ---------------------------------------------------------------------------- sparse loads


@dataclass(frozen=True)
class SparseLoads:
    """Per-step embedding traffic in rows (and ids), for one world size."""

    unique_mean: float  # unique ids per rank
    unique_max: float
    off_owner_mean: float  # unique ids a rank asks of other owners
    busiest_rows: float  # max over ranks of max(rows it sends, rows it receives)
    next_step_share: float  # share of gradient rows the next step reads (urgent ones)
    tokens_eff: float  # Zipf draws per rank that give unique_mean


@functools.lru_cache(maxsize=32)
def _zipf_probs(vocab: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    return p / p.sum()


def _expected_present(p: np.ndarray, draws: float) -> np.ndarray:
    # P(id drawn at least once in `draws` tokens) = 1 - (1 - p)^draws, stably
    return -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-15)))


@functools.lru_cache(maxsize=256)
def zipf_tokens_for_unique(vocab: int, unique: float, s: float = 1.0) -> float:
    """Tokens per rank for which a Zipf(s) vocabulary yields ``unique`` distinct ids."""
    p = _zipf_probs(vocab, s)
    unique = min(max(unique, 1.0), vocab * 0.999)
    lo, hi = 1.0, 1.0
    while _expected_present(p, hi).sum() < unique:
        hi *= 2
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if _expected_present(p, mid).sum() < unique:
            lo = mid
        else:
            hi = mid
    return hi


def sparse_loads(
    vocab: int,
    world_size: int,
    *,
    tokens_per_rank: Optional[float] = None,
    unique_per_rank: Optional[Sequence[float]] = None,
    zipf_s: float = 1.0,
    layout: str = "contiguous",
) -> SparseLoads:
    """Embedding traffic under a contiguous shard plan, ids Zipf-distributed by id.

    fairseq dictionaries are sorted by frequency, so id order is frequency rank and
    rank 0 owns the head of the vocabulary. Measured unique counts, when given, fix
    the effective number of draws; otherwise ``tokens_per_rank`` does. ``layout``
    ``"strided"`` (id ``v`` on rank ``v % N``) shows what spreading the head would give.
    """
    if layout not in ("contiguous", "strided"):
        raise ValueError(f"layout must be 'contiguous' or 'strided', got {layout!r}")
    p = _zipf_probs(vocab, zipf_s)
    if unique_per_rank:
        mean_u = float(np.mean(unique_per_rank))
        draws = zipf_tokens_for_unique(vocab, mean_u, zipf_s)
    elif tokens_per_rank:
        draws = float(tokens_per_rank)
    else:
        raise ValueError("need tokens_per_rank or unique_per_rank")
    q = _expected_present(p, draws)
    u = float(q.sum())
    n = world_size
    base, extra = divmod(vocab, n)
    bounds = np.cumsum([0] + [base + (1 if r < extra else 0) for r in range(n)])
    if layout == "strided":
        own = np.array([q[r::n].sum() for r in range(n)])
    else:
        own = np.array([q[bounds[r] : bounds[r + 1]].sum() for r in range(n)])
    sends = (n - 1) * own  # an owner serves every other rank's requests of its rows
    recvs = u - own  # a rank receives the rows it does not own
    busiest = float(np.max(np.maximum(sends, recvs))) if n > 1 else 0.0
    q_next = _expected_present(p, draws * n)  # read by some rank in the next step
    share = float((q * q_next).sum() / u) if u > 0 else 1.0
    umax = float(max(unique_per_rank)) if unique_per_rank else u
    scale = (float(np.mean(unique_per_rank)) / u) if unique_per_rank and u > 0 else 1.0
    return SparseLoads(
        unique_mean=u * scale,
        unique_max=umax,
        off_owner_mean=u * scale * (n - 1) / n if n > 1 else 0.0,
        busiest_rows=busiest * scale,
        next_step_share=share,
        tokens_eff=draws,
    )


# ---------------------------------------------------------------------------- model profile


@dataclass
class Profile:
    """What the model costs on one rank; the benchmark's ``profiles`` entries.

    ``dense_layers`` are in forward order (input first), every replicated parameter
    except the token table. ``tied_output``: ``None``, ``"gather"`` (the output
    projection reads the full table through an all-gather, its gradient a
    reduce-scatter: what the EmbRace models do) or ``"vocab_parallel"`` (activations
    exchanged instead, DESIGN.md; a cost model only, not a training path).
    """

    name: str
    vocab: int
    dim: int
    dense_layers: List[Tuple[str, int]]
    tokens_per_rank: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    unique_ids_per_rank: Dict[int, List[float]] = field(default_factory=dict)
    tied_output: Optional[str] = None
    element_size: int = 4
    id_size: int = 4
    zipf_s: float = 1.0
    output_tokens_per_rank: Optional[float] = None  # tokens scored by the output layer

    @property
    def dense_numel(self) -> int:
        return sum(n for _, n in self.dense_layers)

    @property
    def table_bytes(self) -> float:
        return float(self.vocab) * self.dim * self.element_size

    def loads(self, world_size: int, layout: str = "contiguous") -> SparseLoads:
        key = (world_size, layout, self.vocab, self.tokens_per_rank, self.zipf_s)
        cache = self.__dict__.setdefault("_loads_cache", {})
        if key not in cache:
            cache[key] = self._loads(world_size, layout)
        return cache[key]

    def _loads(self, world_size: int, layout: str) -> SparseLoads:
        measured = self.unique_ids_per_rank.get(world_size)
        if measured is None and self.unique_ids_per_rank:
            # unique ids per rank depend on the tokens per rank, not on N: any N will do
            measured = self.unique_ids_per_rank[min(self.unique_ids_per_rank)]
        return sparse_loads(
            self.vocab, world_size, tokens_per_rank=self.tokens_per_rank, unique_per_rank=measured,
            zipf_s=self.zipf_s, layout=layout,
        )

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Profile":
        try:
            compute = d["compute_s"]
            return cls(
                name=name,
                vocab=int(d["vocab"]),
                dim=int(d["dim"]),
                dense_layers=[(str(x["name"]), int(x["numel"])) for x in d["dense_layers"]]
                or [("dense", int(d["dense_numel"]))],
                tokens_per_rank=float(d["tokens_per_rank"]),
                forward_s=float(compute["forward"]),
                backward_s=float(compute["backward"]),
                optimizer_s=float(compute.get("optimizer", 0.0)),
                unique_ids_per_rank={int(k): [float(u) for u in v] for k, v in d.get("unique_ids_per_rank", {}).items()},
                tied_output=d.get("tied_output") or None,
                element_size=int(d.get("element_size", 4)),
                id_size=int(d.get("id_size", 4)),
                zipf_s=float(d.get("zipf_s", 1.0)),
            )
        except KeyError as exc:
            raise ValueError(f"profile {name!r} lacks the field {exc}") from None


@dataclass(frozen=True)
class Options:
    """Bucket and piece sizes of each engine (bytes unless said)."""

    legacy_ddp_buffer_numel: int = 2**28  # fairseq LegacyDistributedDataParallel
    c10d_bucket_bytes: int = 25 << 20  # fairseq --bucket-cap-mb 25
    deepspeed_bucket_numel: int = 500_000_000  # reduce_bucket_size
    embrace_bucket_bytes: int = 4 << 20  # ScheduleOptions defaults
    embrace_piece_bytes: int = 1 << 20
    defer_rows: bool = True  # relaxed embedding dependency
    shard_layout: str = "contiguous"  # ShardPlan; "strided" is a what-if
    # tied output (gather): as built, the all-gather runs when the output projection
    # does and the reduce-scatter inside the backward; True models them prefetched /
    # deferred to the optimizer (a what-if)
    overlap_table: bool = False


# ---------------------------------------------------------------------------- link simulation


@dataclass
class _Job:
    name: str
    ready: float
    duration: float
    priority: tuple


def _run_link(jobs: Sequence[_Job]) -> Dict[str, Tuple[float, float]]:
    """One link, non-preemptive: whenever free, the most urgent ready job goes."""
    pending = sorted(jobs, key=lambda j: (j.ready, j.priority))
    spans: Dict[str, Tuple[float, float]] = {}
    now = 0.0
    while pending:
        ready = [j for j in pending if j.ready <= now]
        if not ready:
            now = min(j.ready for j in pending)
            continue
        job = min(ready, key=lambda j: (j.priority, j.ready))
        pending.remove(job)
        spans[job.name] = (now, now + job.duration)
        now += job.duration
    return spans


# ---------------------------------------------------------------------------- prediction


@dataclass
class Prediction:
    strategy: str
    world_size: int
    step_s: float
    compute_s: float
    comm_s: float  # link busy time per step
    exposed_comm_s: float  # step time beyond compute
    detail: Dict[str, float] = field(default_factory=dict)

    @property
    def hidden_share(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 1.0


def _specs(profile: Profile, extra_output: bool) -> List[TensorSpec]:
    specs = [TensorSpec(n, numel, profile.element_size, i) for i, (n, numel) in enumerate(profile.dense_layers)]
    if extra_output:  # the tied output projection: farthest from the input, its gradient ready first
        specs.append(TensorSpec("output_projection", profile.vocab * profile.dim, profile.element_size, len(specs)))
    return specs


def _ready_times(specs: Sequence[TensorSpec], backward_s: float) -> Dict[int, float]:
    """When each tensor's gradient is ready, the backward split by size (output first)."""
    total = sum(s.numel for s in specs) or 1
    t, out = 0.0, {}
    for i in readiness_order(specs):
        t += backward_s * specs[i].numel / total
        out[i] = t
    return out


def _flat_buckets(numels: Iterable[int], cap: int) -> List[int]:
    buckets, cur = [], 0
    for n in numels:
        if cur and cur + n > cap:
            buckets.append(cur)
            cur = 0
        cur += n
    if cur:
        buckets.append(cur)
    return buckets


def predict(profile: Profile, strategy: str, world_size: int, net: Network, opts: Options = Options(),
            compute_scale: float = 1.0) -> Prediction:
    """Steady-state step time of ``strategy`` on ``world_size`` ranks.

    ``compute_scale`` multiplies the profile's compute (ranks sharing CPU cores)."""
    strategy = canonical_strategy(strategy)
    n = world_size
    F, B, O = (compute_scale * t for t in (profile.forward_s, profile.backward_s, profile.optimizer_s))
    if strategy.startswith("embrace") and n > 1:
        # each rank steps only its shard of the table (the profile times the full model)
        full = profile.dense_numel + profile.vocab * profile.dim
        O *= (profile.dense_numel + -(-profile.vocab // n) * profile.dim) / full
    compute = F + B + O
    if n <= 1:
        return Prediction(strategy, n, compute, compute, 0.0, 0.0)
    e, D = profile.element_size, profile.dim
    tied = profile.tied_output
    dense_numels = [numel for _, numel in profile.dense_layers]
    table_numel = profile.vocab * D
    loads = profile.loads(n, opts.shard_layout)
    detail: Dict[str, float] = {}

    if strategy in ("fairseq_legacy_ddp", "deepspeed"):
        cap = opts.legacy_ddp_buffer_numel if strategy == "fairseq_legacy_ddp" else opts.deepspeed_bucket_numel
        # all parameters, the table among them (registration order puts it first)
        buckets = _flat_buckets([table_numel] + dense_numels, cap)
        comm = sum(net.allreduce(b * e, n) for b in buckets)
        detail["allreduce_s"] = comm
        return Prediction(strategy, n, compute + comm, compute, comm, comm, detail)

    if strategy == "fairseq_c10d":
        # the table is used at the input (and at the output when tied): ready at the end
        specs = [TensorSpec("embed_tokens", table_numel, e, 0)] + _specs(profile, False)
        ready = _ready_times(specs[1:], B)
        ready_all = {0: B, **{i + 1: t for i, t in ready.items()}}
        order = sorted(range(len(specs)), key=lambda i: (ready_all[i], -i))
        buckets = make_buckets(specs, order, opts.c10d_bucket_bytes)
        jobs = [
            _Job(f"b{b.index}", F + max(ready_all[i] for i in b.tensors), net.allreduce(b.nbytes, n), (b.index,))
            for b in buckets
        ]
        spans = _run_link(jobs)
        end = max([F + B] + [s[1] for s in spans.values()])
        comm = sum(j.duration for j in jobs)
        step = end + O
        return Prediction(strategy, n, step, compute, comm, step - compute, detail)

    if strategy == "sparse_allgather":
        dense_comm = sum(net.allreduce(b * e, n) for b in _flat_buckets(dense_numels, opts.deepspeed_bucket_numel))
        if tied is not None:
            # the table's gradient is dense (output projection): all-reduced with it
            sparse = net.allreduce(profile.table_bytes, n)
        else:
            umax = loads.unique_max
            sparse = 2 * net.allgather(8.0 * n, n)  # sizes, twice (indices, values)
            sparse += net.allgather(n * umax * 8.0, n)  # int64 indices, padded to the largest
            sparse += net.allgather(n * umax * D * e, n)  # gradient rows, padded
        detail.update(allreduce_s=dense_comm, sparse_s=sparse)
        comm = dense_comm + sparse
        return Prediction(strategy, n, compute + comm, compute, comm, comm, detail)

    # ------------------------------------------------------------------ EmbRace
    hdr = net.alltoall((n - 1) * HEADER_BYTES_PER_PEER, n)
    ids_busiest = loads.busiest_rows * profile.id_size
    rows_busiest = loads.busiest_rows * D * e
    x_ids = hdr + net.alltoall(ids_busiest, n)
    x_rows = net.alltoall(rows_busiest, n)
    x_grad = net.alltoall(rows_busiest, n)
    max_shard = -(-profile.vocab // n)
    gather = net.allgather(n * max_shard * D * e, n) if tied == "gather" else 0.0
    table_rs = net.reduce_scatter(profile.table_bytes, n) if tied == "gather" else 0.0
    out_tokens = profile.output_tokens_per_rank or profile.tokens_per_rank
    vp_fwd = vp_bwd = 0.0
    if tied == "vocab_parallel":
        # all-gather hidden states, reduce-scatter their gradients, softmax statistics
        vp_fwd = net.allgather(n * out_tokens * D * e, n) + net.allgather(n * out_tokens * 2 * 4, n)
        vp_bwd = net.reduce_scatter(n * out_tokens * D * e, n)
    detail.update(exchange_fwd_s=x_ids + x_rows, grad_rows_s=x_grad, table_gather_s=gather, table_grad_s=table_rs)

    if strategy == "embrace_noschedule":
        specs = _specs(profile, False)
        buckets = make_buckets(specs, readiness_order(specs), opts.embrace_bucket_bytes)
        dense_comm = sum(net.allreduce(b.nbytes, n) for b in buckets)
        comm = x_ids + x_rows + x_grad + gather + table_rs + vp_fwd + vp_bwd + dense_comm
        detail["allreduce_s"] = dense_comm
        return Prediction(strategy, n, compute + comm, compute, comm, comm, detail)

    # embrace_schedule: one step on a priority link, steady state (deferred rows of
    # the previous step arrive at t=0 with the forward exchange)
    jobs: List[_Job] = []
    share = loads.next_step_share if opts.defer_rows else 1.0
    piece = opts.embrace_piece_bytes

    def add(name: str, ready: float, total_bytes: float, cost, prio: tuple) -> None:
        # one collective, as the implementation issues it (only dense buckets are cut)
        if total_bytes > 0:
            jobs.append(_Job(name, ready, cost(total_bytes), prio))

    # forward: the exchange goes first and the forward waits for it
    jobs.append(_Job("exchange", 0.0, x_ids + x_rows, (0,)))
    add("deferred", 0.0, rows_busiest * (1 - share), lambda b: net.alltoall(b, n), (2,))
    gather_bytes = n * max_shard * D * e
    if gather and opts.overlap_table:  # prefetched while the forward runs
        add("gather", 0.0, gather_bytes, lambda b: net.allgather(b, n), (1,))
    spans = _run_link(jobs)
    fwd_end = spans["exchange"][1] + F + vp_fwd
    bwd_start = fwd_end
    if gather and opts.overlap_table:
        bwd_start = max(fwd_end, spans["gather"][1])
    elif gather:  # as built: the output projection gathers the table when it runs
        add("gather", fwd_end, gather_bytes, lambda b: net.allgather(b, n), (0, 1))
        spans = _run_link(jobs)
        bwd_start = spans["gather"][1]
    specs = _specs(profile, tied == "gather")
    ready = _ready_times(specs, B)
    stall = 0.0
    if gather:  # the output projection's gradient is ready first
        t_out = bwd_start + ready[len(specs) - 1]
        if opts.overlap_table:  # needed only by the optimizer: least urgent
            add("table_grad", t_out, profile.table_bytes, lambda b: net.reduce_scatter(b, n), (5,))
        else:  # as built: the reduce-scatter runs inside the backward, which waits for it
            add("table_grad", t_out, profile.table_bytes, lambda b: net.reduce_scatter(b, n), (0, 2))
            spans = _run_link(jobs)
            stall = spans["table_grad"][1] - t_out
    # backward: dense pieces in the static 2D order, input-near first
    dense_specs = specs[: len(profile.dense_layers)]
    buckets = make_buckets(dense_specs, readiness_order(dense_specs), opts.embrace_bucket_bytes)
    for b in buckets:
        t = bwd_start + stall + max(ready[i] for i in b.tensors)
        for p in cut_pieces(b, piece):
            jobs.append(_Job(f"dense{b.index}.{p.index}", t, net.allreduce(p.nbytes, n), (4, b.priority, b.index, p.index)))
    bwd_end = bwd_start + stall + B + vp_bwd
    add("urgent_rows", bwd_end, rows_busiest * share, lambda b: net.alltoall(b, n), (3,))
    spans = _run_link(jobs)
    end = max([bwd_end] + [s[1] for s in spans.values()])
    step = end + O
    comm = sum(j.duration for j in jobs) + vp_fwd + vp_bwd
    detail.update(deferred_share=1 - share, busiest_rows=loads.busiest_rows)
    return Prediction(strategy, n, step, compute, comm, step - compute, detail)


# ---------------------------------------------------------------------------- validation


def _runs_and_profiles(bench: dict) -> Tuple[Dict[str, Profile], List[dict]]:
    if "profiles" not in bench or "runs" not in bench:
        raise ValueError("bench JSON needs 'profiles' and 'runs' objects")
    profiles = {name: Profile.from_json(name, d) for name, d in bench["profiles"].items()}
    runs = list(bench["runs"])
    for name, prof in profiles.items():
        # a profile that does not say: runs that all-gathered the table had a tied output
        if "tied_output" not in bench["profiles"][name] and any(
            r.get("model") == name and (r.get("bytes_per_rank_per_step") or {}).get("table_gather", 0) > 0 for r in runs
        ):
            prof.tied_output = "gather"
    return profiles, runs


def validate(bench: dict, *, latency_floor_s: float = 0.0, efficiency: float = 1.0, overhead_s: float = 0.0,
             host_s_per_byte: float = 0.0, tied: Optional[Dict[str, str]] = None,
             opts: Options = Options(defer_rows=False), oversubscription: bool = True) -> dict:
    """Predict every measured run of a bench JSON; relative errors per run and summary.

    By default the schedule is modelled as implemented (no deferral of gradient rows
    into the next forward: the exchange is synchronous in ``ShardedEmbedding``).
    With ``oversubscription`` the compute (measured one process at a time) is scaled
    by ``max(1, N / cpus)`` when N ranks share the machine's ``cpus`` cores.
    """
    profiles, runs = _runs_and_profiles(bench)
    knobs = {"efficiency": efficiency, "overhead_s": overhead_s, "host_s_per_byte": host_s_per_byte,
             "latency_floor_s": latency_floor_s}
    return _validate(profiles, runs, bench.get("meta", {}), knobs, tied, opts, oversubscription)


def _validate(profiles: Dict[str, Profile], runs: List[dict], meta: dict, knobs: Dict[str, float],
              tied: Optional[Dict[str, str]], opts: Options, oversubscription: bool) -> dict:
    if meta.get("fallback_loopback"):
        # no emulated links: the network model has nothing to predict
        return {"runs": [], "skipped": f"runs on loopback ({meta.get('fallback_reason')}), no emulated links",
                "mean_abs_rel_error": None, "median_abs_rel_error": None, "max_abs_rel_error": None, "by_strategy": {}}
    latency_applied = meta.get("latency_applied", True)
    cpus = (meta.get("machine") or {}).get("cpus") or 0
    for name, mode in (tied or {}).items():
        if name not in profiles:
            raise ValueError(f"--tied-output names the unknown model {name!r}")
        profiles[name].tied_output = None if mode == "none" else mode
    rows = []
    for run in runs:
        if run.get("median_step_s") is None or run.get("model") not in profiles:
            continue
        try:
            strategy = canonical_strategy(str(run["strategy"]))
        except ValueError:
            continue
        n = int(run["world_size"])
        share = max(1.0, n / cpus) if (oversubscription and cpus) else 1.0
        net = Network(
            float(run["link_gbit"]),
            latency_s=max(float(run.get("latency_ms", 0.0)) / 1e3 if latency_applied else 0.0, knobs["latency_floor_s"]),
            efficiency=knobs["efficiency"],
            overhead_s=knobs["overhead_s"],
            host_s_per_byte=knobs["host_s_per_byte"],
            contention=share,
        )
        pred = predict(profiles[run["model"]], strategy, n, net, opts, compute_scale=share)
        measured = float(run["median_step_s"])
        steps = [float(x) for x in run.get("step_s") or []]
        # the run's own spread (interquartile range over the median): a noise floor
        spread = float(np.subtract(*np.percentile(steps, [75, 25])) / measured) if len(steps) >= 4 else None
        rows.append(
            {
                "measured_rel_iqr": spread,
                "model": run["model"],
                "world_size": n,
                "link_gbit": float(run["link_gbit"]),
                "strategy": strategy,
                "measured_s": measured,
                "predicted_s": pred.step_s,
                "rel_error": (pred.step_s - measured) / measured,
            }
        )
    errs = [abs(r["rel_error"]) for r in rows]
    # speedup of (e) over each other strategy, measured vs predicted, per setting
    speedups = []
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["world_size"], r["link_gbit"]), {})[r["strategy"]] = r
    for (model, n, gbit), g in groups.items():
        e = g.get("embrace_schedule")
        for name, r in g.items():
            if e is None or name == "embrace_schedule":
                continue
            speedups.append({"model": model, "world_size": n, "link_gbit": gbit, "over": name,
                             "measured": r["measured_s"] / e["measured_s"], "predicted": r["predicted_s"] / e["predicted_s"]})
    by_strategy: Dict[str, List[float]] = {}
    for r in rows:
        by_strategy.setdefault(r["strategy"], []).append(abs(r["rel_error"]))
    return {
        "runs": rows,
        "mean_abs_rel_error": float(np.mean(errs)) if errs else None,
        "median_abs_rel_error": float(np.median(errs)) if errs else None,
        "max_abs_rel_error": float(np.max(errs)) if errs else None,
        "by_strategy": {k: float(np.mean(v)) for k, v in by_strategy.items()},
        "speedups_of_embrace_schedule": speedups,
        "speedup_mean_abs_rel_error": (float(np.mean([abs(x["predicted"] / x["measured"] - 1) for x in speedups]))
                                       if speedups else None),
        "median_measured_rel_iqr": (float(np.median([r["measured_rel_iqr"] for r in rows]))
                                    if rows and all(r["measured_rel_iqr"] is not None for r in rows) else None),
        "network": dict(knobs, latency_applied=latency_applied, cpus=cpus, oversubscription=oversubscription),
        "options": asdict(opts),
    }


FIT_GRID = {
    "efficiency": (0.5, 0.75, 1.0),
    "overhead_s": (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3),
    "host_s_per_byte": (0.0, 1e-9, 2e-9, 4e-9, 6e-9, 8e-9, 12e-9, 16e-9),
}


def fit_network(bench: dict, *, tied: Optional[Dict[str, str]] = None, opts: Options = Options(defer_rows=False),
                holdouts: Sequence[str] = ("link_gbit", "model"), grid: Dict[str, Sequence[float]] = FIT_GRID,
                oversubscription: bool = True) -> dict:
    """Fit the network knobs (efficiency, per-collective overhead, host CPU per byte).

    A grid search minimising the mean relative error. For each field in ``holdouts``,
    the runs with each value of it are predicted by knobs fitted on the other runs (an
    out-of-sample error: e.g. 10 Gbit/s predicted from knobs fitted at 1 Gbit/s).
    """
    profiles, runs = _runs_and_profiles(bench)  # parsed once: their sparse loads are cached
    meta = bench.get("meta", {})
    cache: Dict[tuple, dict] = {}

    def result(k: tuple) -> dict:
        if k not in cache:
            knobs = dict(zip(grid, k), latency_floor_s=0.0)
            cache[k] = _validate(profiles, runs, meta, knobs, tied, opts, oversubscription)
        return cache[k]

    def mean_err(k: tuple, keep) -> float:
        errs = [abs(r["rel_error"]) for r in result(k)["runs"] if keep(r)]
        return float(np.mean(errs)) if errs else float("inf")

    combos = list(itertools.product(*grid.values()))

    def best(keep) -> tuple:
        return min(combos, key=lambda k: mean_err(k, keep))

    k = best(lambda r: True)
    out = dict(zip(grid, k), in_sample_mean_abs_rel_error=mean_err(k, lambda r: True), holdout={})
    for field_name in holdouts:
        values = sorted({r[field_name] for r in result(k)["runs"]})
        if len(values) < 2:
            continue
        held = []
        for v in values:
            kv = best(lambda r, v=v: r[field_name] != v)
            held += [abs(r["rel_error"]) for r in result(kv)["runs"] if r[field_name] == v]
        out["holdout"][field_name] = float(np.mean(held))
    return out


# ---------------------------------------------------------------------------- paper models

# Assumptions for the projection to GPU clusters (stated, not measured):
GPU_SUSTAINED_FLOPS = 30e12  # V100-class, mixed precision, sustained (~24% of 125 TFLOP/s peak)
GPU_MEMORY_BYTES_PER_S = 800e9  # HBM2, for the optimizer step
ADAM_BYTES_PER_PARAM = 32  # fp32 master weight, two moments, gradient: read + write
PAPER_LATENCY_S = 10e-6  # per message step on 10-100 Gbit/s Ethernet/IB (assumed)


def _enc_layer(d: int, f: int) -> int:  # self-attention + FFN + 2 layer norms (fairseq layout)
    return 4 * d * d + 4 * d + 2 * d * f + d + f + 4 * d


def _dec_layer(d: int, f: int, cross: bool = True) -> int:
    return (8 * d * d + 8 * d if cross else 4 * d * d + 4 * d) + 2 * d * f + d + f + (6 if cross else 4) * d


def _gpu_profile(name, vocab, dim, layers, tokens, lookups, ctx, n_layers_attn, tied, zipf_s, output_numel_compute,
                 output_tokens=None, extra_params=0) -> Profile:
    dense = sum(n for _, n in layers)
    out_tokens = output_tokens or tokens
    # training FLOPs: 6 per parameter per token (2 forward, 4 backward), plus attention
    # scores 6 * layers * ctx * d per token, plus the output layer over its tokens
    flops = 6.0 * (dense - extra_params) * tokens + 6.0 * n_layers_attn * ctx * dim * tokens
    flops += 6.0 * output_numel_compute * out_tokens
    fwd = flops / 3 / GPU_SUSTAINED_FLOPS
    params = dense + vocab * dim
    opt = params * ADAM_BYTES_PER_PARAM / GPU_MEMORY_BYTES_PER_S
    return Profile(
        name=name, vocab=vocab, dim=dim, dense_layers=layers, tokens_per_rank=lookups, forward_s=fwd,
        backward_s=2 * fwd, optimizer_s=opt, tied_output=tied, element_size=2, id_size=4, zipf_s=zipf_s,
        output_tokens_per_rank=out_tokens,
    )


def paper_profiles() -> Dict[str, Profile]:
    """The paper's three model families at their usual sizes (fp16 gradients)."""
    d, f = 512, 2048
    tr_layers = [(f"encoder.layers.{i}", _enc_layer(d, f)) for i in range(6)]
    tr_layers += [(f"decoder.layers.{i}", _dec_layer(d, f)) for i in range(6)]
    transformer = _gpu_profile(
        "transformer_base_wmt_en_de", 32768, d, tr_layers, tokens=3500, lookups=7000, ctx=30, n_layers_attn=18,
        tied="gather", zipf_s=1.0, output_numel_compute=32768 * d,
    )
    d, f, L = 1024, 4096, 16
    lm_layers = [(f"decoder.layers.{i}", _dec_layer(d, f, cross=False)) for i in range(L)]
    # adaptive softmax, cutoffs 20000,60000, factor 4 (fairseq transformer_lm_wiki103)
    head = d * (20000 + 2)
    tail1 = d * (d // 4) + (d // 4) * 40000
    tail2 = d * (d // 16) + (d // 16) * (267744 - 60000)
    lm_layers += [("decoder.adaptive_softmax", head + tail1 + tail2)]
    lm = _gpu_profile(
        "transformer_lm_wikitext103_267k", 267744, d, lm_layers, tokens=3072, lookups=3072, ctx=512, n_layers_attn=L,
        tied=None, zipf_s=1.0, output_numel_compute=0,
    )
    d, f = 768, 3072
    bert_layers = [("embeddings.position_type_norm", 512 * d + 2 * d + 2 * d)]
    bert_layers += [(f"encoder.layer.{i}", _enc_layer(d, f)) for i in range(12)]
    bert_layers += [("pooler", d * d + d), ("cls.predictions.transform", d * d + d + 2 * d + 30522)]
    bert = _gpu_profile(
        "bert_base", 30522, d, bert_layers, tokens=4096, lookups=4096, ctx=128, n_layers_attn=12, tied="gather",
        zipf_s=1.0, output_numel_compute=30522 * d, output_tokens=int(0.15 * 4096), extra_params=512 * d,
    )
    return {p.name: p for p in (transformer, lm, bert)}


# The paper's reported figures, as found (abstracts of arXiv 2110.09132 v1 and v2).
PAPER_REPORTED = [
    {
        "claim": "up to 30.66X speedup on 16 GPUs clusters among four popular distributed training baselines",
        "version": "arXiv 2110.09132v1 abstract",
        "source": "https://deepai.com/publication/embrace-accelerating-sparse-communication-for-distributed-training-of-nlp-neural-networks",
    },
    {
        "claim": "up to 2.41X speedup compared to the state-of-the-art distributed training baselines",
        "version": "arXiv 2110.09132v2 abstract",
        "source": "https://paperswithcode.com/paper/embrace-accelerating-sparse-communication-for",
    },
]


def paper_study(links_gbit: Sequence[float] = (10, 25, 100), worlds: Sequence[int] = (8, 16, 32, 64)) -> dict:
    out = {"assumptions": {
        "gpu_sustained_flops": GPU_SUSTAINED_FLOPS, "gpu_memory_bytes_per_s": GPU_MEMORY_BYTES_PER_S,
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM, "latency_s": PAPER_LATENCY_S, "element_size": 2,
        "embrace_piece_bytes": 16 << 20, "embrace_bucket_bytes": 25 << 20,
    }, "paper_reported": PAPER_REPORTED, "models": {}}
    opts = Options(embrace_bucket_bytes=25 << 20, embrace_piece_bytes=16 << 20)
    for name, prof in paper_profiles().items():
        m = {"vocab": prof.vocab, "dim": prof.dim, "dense_numel": prof.dense_numel, "tied_output": prof.tied_output,
             "compute_s": {"forward": prof.forward_s, "backward": prof.backward_s, "optimizer": prof.optimizer_s},
             "tokens_per_rank": prof.tokens_per_rank, "results": []}
        strided = Options(**{**asdict(opts), "shard_layout": "strided"})
        variants = [("as_built", prof, opts), ("strided_shards", prof, strided)]
        if prof.tied_output == "gather":
            variants.append(("overlapped_table", prof, Options(**{**asdict(opts), "overlap_table": True})))
            vp = Profile(**{**asdict(prof), "tied_output": "vocab_parallel"})
            variants.append(("vocab_parallel_output", vp, opts))
        for variant, p, o in variants:
            for link in links_gbit:
                net = Network(link, latency_s=PAPER_LATENCY_S)
                for w in worlds:
                    preds = {s: predict(p, s, w, net, o) for s in STRATEGIES}
                    e = preds["embrace_schedule"].step_s
                    no_defer = predict(p, "embrace_schedule", w, net, Options(**{**asdict(o), "defer_rows": False}))
                    m["results"].append({
                        "variant": variant, "link_gbit": link, "world_size": w,
                        "step_s": {s: pr.step_s for s, pr in preds.items()},
                        "speedup_of_embrace_schedule": {s: pr.step_s / e for s, pr in preds.items()},
                        "hidden_share_embrace_schedule": preds["embrace_schedule"].hidden_share,
                        "embrace_schedule_without_row_deferral_s": no_defer.step_s,
                        "unique_ids_per_rank": p.loads(w, o.shard_layout).unique_mean,
                        "busiest_rows": p.loads(w, o.shard_layout).busiest_rows,
                        "deferred_share": preds["embrace_schedule"].detail.get("deferred_share"),
                    })
        out["models"][name] = m
    return out


def _markdown(study: dict, world: int = 16) -> str:
    lines = [
        f"Predicted speedup of EmbRace with the schedule (e) over each baseline, {world} GPUs",
        "",
        "| model | output | link | legacy_ddp | c10d | DeepSpeed | sparse all-gather | EmbRace no schedule "
        "| gain of row deferral | comm. hidden by (e) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in study["models"].items():
        for r in m["results"]:
            if r["world_size"] != world:
                continue
            s = r["speedup_of_embrace_schedule"]
            out = {"as_built": str(m["tied_output"] or "untied"),
                   "strided_shards": f"{m['tied_output'] or 'untied'}, strided shards (what-if)",
                   "overlapped_table": "gather prefetched, reduce-scatter deferred (what-if)",
                   "vocab_parallel_output": "vocab-parallel (design)"}[r["variant"]]
            lines.append(
                f"| {name} | {out} | {r['link_gbit']:g} Gbit/s | {s['fairseq_legacy_ddp']:.2f}x | {s['fairseq_c10d']:.2f}x | "
                f"{s['deepspeed']:.2f}x | {s['sparse_allgather']:.2f}x | {s['embrace_noschedule']:.2f}x | "
                f"{r['embrace_schedule_without_row_deferral_s'] / r['step_s']['embrace_schedule']:.2f}x | "
                f"{100 * r['hidden_share_embrace_schedule']:.0f}% |"
            )
    lines += ["", "Reported by the paper (as found; no per-model figures were found):", ""]
    for c in study["paper_reported"]:
        lines.append(f"* \"{c['claim']}\" ({c['version']}, {c['source']})")
    return "\n".join(lines) + "\n"


def _plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(study["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = [r for r in study["models"][name]["results"] if r["variant"] == "as_built"]
        for link, style in zip(sorted({r["link_gbit"] for r in rows}), ("-", "--", ":")):
            sub = sorted((r for r in rows if r["link_gbit"] == link), key=lambda r: r["world_size"])
            xs = [r["world_size"] for r in sub]
            for base, color in (("fairseq_legacy_ddp", "C0"), ("deepspeed", "C1"), ("sparse_allgather", "C2"),
                                ("embrace_noschedule", "C3")):
                ax.plot(xs, [r["speedup_of_embrace_schedule"][base] for r in sub], style, color=color,
                        label=f"vs {base}, {link:g} Gbit/s")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speedup of EmbRace (schedule)")
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- CPU measurement


def fit_zipf_exponent(counts: Sequence[float], lo: int = 10, hi: int = 2000) -> float:
    """Least-squares slope of log count against log rank (ranks ``lo..hi``)."""
    c = np.sort(np.asarray([x for x in counts if x > 0], dtype=np.float64))[::-1]
    hi = min(hi, len(c))
    if hi - lo < 10:
        return 1.0
    r = np.arange(lo + 1, hi + 1, dtype=np.float64)
    slope = np.polyfit(np.log(r), np.log(c[lo:hi]), 1)[0]
    return float(-slope)


def measure_translation_profile(data_dir: str, *, max_tokens: int = 512, steps: int = 6, worlds=(2, 4)) -> dict:
    """Time fairseq's stock ``transformer`` (2+2 layers, d=256, shared 8k vocabulary)
    forward, backward and Adam step on this CPU, one process, one thread; unique ids
    of real consecutive batches, dealt to ``N`` ranks. A profile in the bench format."""
    import time

    import torch
    from fairseq import options, tasks

    torch.set_num_threads(1)
    argv = [data_dir, "--task", "translation", "--source-lang", "de", "--target-lang", "en", "--arch", "transformer",
            "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
            "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0.0", "--cpu", "--seed", "1",
            "--max-tokens", str(max_tokens)]
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    task = tasks.setup_task(args)
    task.load_dataset("train")
    torch.manual_seed(1)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=max_tokens, seed=1).next_epoch_itr(shuffle=True)
    batches = [next(itr) for _ in range(steps + max(worlds))]
    times = {"forward": [], "backward": [], "optimizer": []}
    for i, sample in enumerate(batches[: steps + 1]):
        t0 = time.perf_counter()
        loss, _, _ = criterion(model, sample)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if i:  # the first step warms up
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
            times["optimizer"].append(t3 - t2)

    def ids(sample):
        return torch.cat([sample["net_input"]["src_tokens"].reshape(-1), sample["net_input"]["prev_output_tokens"].reshape(-1)])

    table = model.encoder.embed_tokens.weight
    layers: Dict[str, int] = {}
    for name, p in model.named_parameters():
        if p is table:
            continue
        parts = name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ".".join(parts[:-1])
        layers[key] = layers.get(key, 0) + p.numel()
    unique = {str(n): [int(torch.unique(ids(b)).numel()) for b in batches[steps: steps + n]] for n in worlds}
    counts = task.source_dictionary.count[task.source_dictionary.nspecial:]
    zipf_s = fit_zipf_exponent(counts)
    # the sparse-load model against real batches: the busiest rank's rows under ShardPlan
    from embrace_fairseq.core.shard_plan import ShardPlan

    check = {}
    for n in worlds:
        plan, busiest, uniq = ShardPlan(table.shape[0], n, "contiguous"), [], []  # vs. the contiguous zipf model
        for rep in range(8):
            us = [torch.unique(ids(next(itr))) for _ in range(n)]
            own = [[int(((u >= plan.boundaries[o]) & (u < plan.boundaries[o + 1])).sum()) for o in range(n)] for u in us]
            sends = [sum(own[r][o] for r in range(n) if r != o) for o in range(n)]
            recvs = [len(us[r]) - own[r][r] for r in range(n)]
            busiest.append(max(sends + recvs))
            uniq += [len(u) for u in us]
        model = sparse_loads(table.shape[0], n, unique_per_rank=uniq, zipf_s=zipf_s)
        check[str(n)] = {"busiest_rows_measured": float(np.mean(busiest)), "busiest_rows_zipf": model.busiest_rows,
                         "off_owner_mean_zipf": model.off_owner_mean, "unique_mean": float(np.mean(uniq))}
    return {
        "vocab": table.shape[0], "dim": table.shape[1], "dense_numel": sum(layers.values()),
        "dense_layers": [{"name": k, "numel": v} for k, v in layers.items()],
        "tokens_per_rank": float(np.mean([ids(b).numel() for b in batches])),
        "compute_s": {k: float(np.median(v)) for k, v in times.items()},
        "unique_ids_per_rank": unique, "tied_output": "gather", "zipf_s": zipf_s, "sparse_load_check": check,
        "measured_on": "this CPU, 1 process, 1 thread (stock fairseq transformer)",
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.simulator", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="prediction error against a bench JSON's measured runs")
    v.add_argument("bench_json")
    v.add_argument("--efficiency", type=float, default=1.0, help="share of the line rate collectives reach")
    v.add_argument("--overhead-ms", type=float, default=0.0, help="software cost per collective")
    v.add_argument("--host-ns-per-byte", type=float, default=0.0, help="CPU time per byte sent (one-machine emulation)")
    v.add_argument("--no-oversubscription", action="store_true",
                   help="do not scale compute by ranks per CPU core")
    v.add_argument("--tied-output", action="append", default=[], metavar="MODEL=MODE",
                   help="override a profile's tied_output (none|gather|vocab_parallel)")
    v.add_argument("--defer-rows", action="store_true",
                   help="model the relaxed deferral of gradient rows (a design the exchange does not implement yet)")
    v.add_argument("--fit", action="store_true",
                   help="also fit efficiency, per-collective overhead and host cost per byte (with held-out errors)")
    v.add_argument("--out", help="write the comparison JSON here")
    p = sub.add_parser("paper", help="8-64 GPU projection of the paper's models")
    p.add_argument("--out", default="results/simulator/")
    m = sub.add_parser("measure", help="time the stock translation Transformer on this CPU (a profile JSON)")
    m.add_argument("--data", default="data/deen/bin")
    m.add_argument("--max-tokens", type=int, default=512)
    m.add_argument("--worlds", default="2,4,8", help="world sizes to deal batches to")
    m.add_argument("--out", default="results/simulator/cpu_profile.json")
    a = ap.parse_args(argv)

    if a.cmd == "measure":
        prof = measure_translation_profile(a.data, max_tokens=a.max_tokens, worlds=[int(x) for x in a.worlds.split(",")])
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"profiles": {"translation": prof}, "runs": []}, indent=2))
        print(json.dumps(prof["compute_s"]), f"zipf_s={prof['zipf_s']:.2f}", f"-> {a.out}")
        for n, c in prof["sparse_load_check"].items():
            print(f"N={n}: busiest rank's rows measured {c['busiest_rows_measured']:.0f}, Zipf model "
                  f"{c['busiest_rows_zipf']:.0f} (average off-owner ids {c['off_owner_mean_zipf']:.0f})")
        return 0

    if a.cmd == "validate":
        with open(a.bench_json) as fh:
            bench = json.load(fh)
        tied = dict(x.split("=", 1) for x in a.tied_output)
        res = validate(bench, efficiency=a.efficiency, overhead_s=a.overhead_ms / 1e3,
                       host_s_per_byte=a.host_ns_per_byte * 1e-9, tied=tied, opts=Options(defer_rows=a.defer_rows),
                       oversubscription=not a.no_oversubscription)
        print(f"{'model':12s} {'N':>3s} {'Gbit':>5s} {'strategy':20s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
        for r in res["runs"]:
            print(f"{r['model']:12s} {r['world_size']:3d} {r['link_gbit']:5g} {r['strategy']:20s} "
                  f"{r['measured_s']:9.4f} {r['predicted_s']:9.4f} {100 * r['rel_error']:+6.1f}%")
        if res["mean_abs_rel_error"] is None:
            print(res.get("skipped") or "no measured runs to compare with")
            return 1
        print(f"mean |error| {100 * res['mean_abs_rel_error']:.1f}%, median {100 * res['median_abs_rel_error']:.1f}%, "
              f"max {100 * res['max_abs_rel_error']:.1f}% over {len(res['runs'])} runs"
              + (f"; the runs' own step-time spread (IQR/median) is {100 * res['median_measured_rel_iqr']:.0f}% (median)"
                 if res.get("median_measured_rel_iqr") is not None else ""))
        sp = res.get("speedups_of_embrace_schedule") or []
        if sp:
            print("speedup of embrace_schedule over:   measured  predicted")
            for x in sp:
                print(f"  {x['model']:11s} N={x['world_size']} {x['link_gbit']:4g} Gbit {x['over']:20s} "
                      f"{x['measured']:6.2f}x  {x['predicted']:6.2f}x")
        if sp:
            print(f"mean |error| of the speedups: {100 * res['speedup_mean_abs_rel_error']:.1f}%")
        if a.fit:
            res["fit"] = f = fit_network(bench, tied=tied, opts=Options(defer_rows=a.defer_rows),
                                         oversubscription=not a.no_oversubscription)
            print(f"fitted: efficiency {f['efficiency']:.2f}, overhead {1e3 * f['overhead_s']:.2f} ms per collective, "
                  f"host {1e9 * f['host_s_per_byte']:.0f} ns per byte; mean |error| "
                  f"{100 * f['in_sample_mean_abs_rel_error']:.1f}% in sample"
                  + "".join(f", {100 * e:.1f}% holding out each {k}" for k, e in f["holdout"].items()))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=2))
        return 0

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    study = paper_study()
    (out / "paper_projection.json").write_text(json.dumps(study, indent=2))
    md = _markdown(study)
    (out / "paper_projection.md").write_text(md)
    _plot(study, out / "paper_projection.png")
    print(md)
    print(f"wrote {out / 'paper_projection.json'}, {out / 'paper_projection.md'}, {out / 'paper_projection.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
