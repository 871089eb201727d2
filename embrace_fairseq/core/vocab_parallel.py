"""Vocab-parallel output projection and loss inside data parallelism.

Each rank ``r`` of the data-parallel group keeps its rows ``S_r`` of the output table
``W`` (``V x D``; the tied embedding's own shard, or a sharded untied projection) and
has its own ``T_r`` target positions with hidden states ``H_r``. One step
(docs/DESIGN.md, "Vocab-parallel output layer"):

1. all-gather ``H`` and the targets (one all-gather when every rank has as many
   tokens; otherwise an AlltoAll that sends each rank's rows once, unpadded, since
   gloo's and NCCL's all-gathers need equal sizes); ``M = sum T_r`` tokens;
2. local logits ``Z_r = H W[S_r]^T``: ``M x |S_r|``, never ``M x V``;
3. per token, combine over ranks: max ``m`` (all-reduce MAX), then the sum of
   exponentials ``s``, the target's logit ``z_y`` (from its owner) and, for label
   smoothing, the sum of logits (one all-reduce SUM); ``logZ = m + log s``,
   ``nll = logZ - z_y``, ``smooth = V logZ - sum_v z_v``; for accuracy the argmax over
   the full vocabulary (all-reduce MIN of the candidate id of every rank whose local
   max is the global one: the first index on ties, as ``argmax`` does);
4. each rank returns its own tokens' ``nll`` and ``smooth``.

Backward: the upstream per-token gradients are all-gathered (``M x 2`` floats); each
rank forms its columns of ``dZ = g_nll (p - onehot_y) + g_smooth (V p - 1)``; the
table's gradient ``dZ^T H`` stays on its rank, times ``grad_scale`` (``1/N``: the
data-parallel average convention of the sharded tables); ``dH = dZ W[S_r]`` is summed
over ranks and scattered back to the tokens' owners (an AlltoAll plus a local sum,
no padding).

Volume per rank, elements: ``2 (N-1) T D`` for the activations against
``2 (N-1)/N V D`` for the table: it wins when all ranks' tokens ``N T`` are fewer
than ``V``. :func:`output_bytes` gives both (in bytes, as the ledger counts them) and
:class:`OutputChooser` picks per step from the all-gathered token counts, the same
answer on every rank.

Layout: the module never assumes contiguous shards; it takes the global ids of the
local rows (:func:`shard_rows`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ledger import CommLedger, record_all
from embrace_fairseq.core.ring_volume import ring_allreduce_bytes
from embrace_fairseq.core.trace import mark_start, record_overlapped

logger = logging.getLogger(__name__)

GATHER = "gather"
VOCAB_PARALLEL = "vocab-parallel"
AUTO = "auto"
OUTPUT_MODES = (AUTO, VOCAB_PARALLEL, GATHER)


# --------------------------------------------------------------------------- collectives
# One helper per exchange step, over :mod:`embrace_fairseq.core.collectives` (which places
# tensors on the group's device), each recording its bytes. No-ops at world size 1.


def _world(group) -> Tuple[int, int]:
    return collectives.rank(group), collectives.world_size(group)


def _gather_counts(n: int, group, ledgers: Sequence[CommLedger]) -> List[int]:
    """Every rank's token count (all-gather of one int64)."""
    rank, world = _world(group)
    if world == 1:
        return [int(n)]
    mark_start(list(ledgers))
    parts = collectives.all_gather(torch.tensor([int(n)], dtype=torch.long), group)
    record_all(ledgers, K.SOFTMAX_STATS, (world - 1) * 8, (world - 1) * 8)
    return [int(p.item()) for p in parts]


def _all_gather_rows(x: torch.Tensor, counts: Sequence[int], group, ledgers, kind: str) -> torch.Tensor:
    """Rows of every rank, in rank order (``sum(counts)`` rows): an all-gather when the
    counts are equal, else the unpadded AlltoAll (the same rows on the wire, no padding)."""
    rank, world = _world(group)
    if world == 1:
        return x
    row = math.prod(x.shape[1:]) * x.element_size()
    mark_start(list(ledgers))
    if min(counts) == max(counts):
        out = collectives.all_gather_rows(x, counts, group)
    else:
        out = collectives.all_gather_uneven_rows(x, counts, group)
    record_all(ledgers, kind, (world - 1) * counts[rank] * row, (sum(counts) - counts[rank]) * row)
    return out


def _all_reduce(x: torch.Tensor, op: str, group, ledgers, kind: str) -> torch.Tensor:
    rank, world = _world(group)
    if world == 1 or x.numel() == 0:
        return x
    mark_start(list(ledgers))
    x = collectives.all_reduce(x.contiguous(), op, group)
    nbytes = int(ring_allreduce_bytes(x.numel() * x.element_size(), world))
    record_all(ledgers, kind, nbytes, nbytes)
    return x


class _InFlight:
    """An asynchronous step of the exchange: :meth:`wait` returns its result and then
    records its bytes, and its time split into the part the caller computed beside and
    the part it waited (:func:`~embrace_fairseq.core.trace.record_overlapped`)."""

    def __init__(self, pending: Optional[collectives.Pending], ledgers, kind: str, sent: int, received: int,
                 local: Optional[torch.Tensor] = None) -> None:
        self.pending, self.ledgers, self.kind, self.sent, self.received, self.local = (
            pending, ledgers, kind, sent, received, local)

    def wait(self) -> torch.Tensor:
        if self.pending is None:  # world size 1: nothing was sent
            return self.local
        waited = time.perf_counter() * 1e6
        out = self.pending.wait()
        record_overlapped(list(self.ledgers), self.kind, self.sent, self.received, self.pending, waited)
        return out


def _gather_rows_async(x: torch.Tensor, counts: Sequence[int], group, ledgers, kind: str) -> _InFlight:
    """:func:`_all_gather_rows`, issued now and waited for later."""
    rank, world = _world(group)
    if world == 1:
        return _InFlight(None, ledgers, kind, 0, 0, local=x)
    row = math.prod(x.shape[1:]) * x.element_size()
    pending = collectives.gather_token_rows_async(x, counts, group)
    return _InFlight(pending, ledgers, kind, (world - 1) * counts[rank] * row, (sum(counts) - counts[rank]) * row)


def _reduce_scatter_rows_async(x: torch.Tensor, counts: Sequence[int], group, ledgers, kind: str) -> _InFlight:
    """Sum ``x`` (``sum(counts)`` rows, in rank order) over ranks and keep this rank's
    rows, issued now and waited for later: an AlltoAll with uneven splits and a local
    sum at the wait (gloo has no reduce-scatter)."""
    rank, world = _world(group)
    if world == 1:
        return _InFlight(None, ledgers, kind, 0, 0, local=x)
    mine = counts[rank]
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    pending = collectives.reduce_scatter_rows_async(x, counts, group)
    return _InFlight(pending, ledgers, kind, (sum(counts) - mine) * row, (world - 1) * mine * row)


# --------------------------------------------------------------------------- pure math


def shard_rows(start: int, end: int) -> torch.Tensor:
    """Global ids of a contiguous shard's rows (a strided layout passes its own ids)."""
    return torch.arange(start, end, dtype=torch.long)


def local_columns(target: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Column of each target inside the local shard (``-1`` where another rank owns it)."""
    pos = torch.full((vocab_size,), -1, dtype=torch.long, device=target.device)
    pos[rows.to(target.device)] = torch.arange(rows.numel(), dtype=torch.long, device=target.device)
    return pos[target.long()]


@dataclass
class LocalStats:
    """Per-token statistics of one shard's logits (``M`` tokens)."""

    max: torch.Tensor  # local max logit (-inf for an empty shard)
    argmax: torch.Tensor  # global id of the local max (vocab_size for an empty shard)


def local_max(z: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> LocalStats:
    if z.shape[1] == 0:
        m = z.new_full((z.shape[0],), float("-inf"))
        return LocalStats(m, torch.full((z.shape[0],), vocab_size, dtype=torch.long, device=z.device))
    m, idx = z.max(dim=1)
    return LocalStats(m, rows.to(z.device)[idx])


def logits_into(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """``out = hidden @ weight^T`` (float32 ``out``): straight into ``out`` when nothing
    casts (float32, no autocast), else computed and copied (fp16/bf16 logits upcast)."""
    if out.shape[0] == 0:
        return
    if hidden.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(hidden.device.type):
        torch.mm(hidden, weight.t(), out=out)
    else:
        out.copy_(F.linear(hidden, weight))


def target_logits(z: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``z_y`` per token where this shard owns the target, else 0."""
    zy = z.new_zeros(z.shape[0])
    owned = (col >= 0).nonzero().squeeze(1)
    if owned.numel():
        zy[owned] = z[owned, col[owned]]
    return zy


def exp_shifted_(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``z <- exp(z - m)`` per token, in place (the softmax numerators against the global
    max ``m``, each at most 1); returns ``z``. The logits are not kept: the backward
    needs only these and the per-token sums (:func:`logits_grad_`)."""
    return z.sub_(m.unsqueeze(1)).exp_()


def losses_from_stats(m: torch.Tensor, sums: torch.Tensor, vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(logZ, nll, smooth)`` per token from the global max and the combined
    ``[sum exp(z - m), z_y, (sum z)]``: ``nll = -log p_y``, ``smooth = -sum_v log p_v``
    (None without smoothing)."""
    log_z = m + torch.log(sums[0])
    nll = log_z - sums[1]
    smooth = vocab_size * log_z - sums[2] if sums.shape[0] > 2 else None
    return log_z, nll, smooth


def logits_grad_(
    e: torch.Tensor, s: torch.Tensor, col: torch.Tensor, g_nll: torch.Tensor,
    g_smooth: Optional[torch.Tensor], vocab_size: int,
) -> torch.Tensor:
    """This shard's columns of ``d(sum g_nll nll + g_smooth smooth)/dZ``, in place of the
    numerators ``e = exp(z - m)`` (``s``: their global per-token sum, so ``p = e / s``):
    ``g_nll (p - onehot_y) + g_smooth (V p - 1)``. Returns ``e``, overwritten."""
    coef = g_nll if g_smooth is None else g_nll + vocab_size * g_smooth
    dz = e.mul_((coef / s).unsqueeze(1))
    if g_smooth is not None:
        dz.sub_(g_smooth.unsqueeze(1))
    owned = (col >= 0).nonzero().squeeze(1)
    if owned.numel():
        dz[owned, col[owned]] -= g_nll[owned]
    return dz


# --------------------------------------------------------------------------- autograd


@dataclass
class VocabShardSpec:
    """What the function needs to know about the sharded table besides its weight."""

    rows: torch.Tensor  # global ids of the local rows, in the weight's row order
    vocab_size: int
    group: object = None
    grad_scale: float = 1.0  # on the shard's gradient: 1/N for the data-parallel average
    ledgers: Tuple[CommLedger, ...] = ()


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``(hidden T x D, weight shard, target T)`` -> ``(nll T, smooth T, n_correct)``
    for this rank's tokens, computed against every rank's shard. Collective.

    Overlap: the hidden states' all-gather is in flight while this rank computes its
    own tokens' logits, and the reduce-scatter of the hidden-state gradients while it
    computes the shard's weight gradient (the two products that need no peer). The
    logits are overwritten by their softmax numerators in forward and by their
    gradient in backward: one ``M x V/N`` buffer, one ``exp``. The function runs
    once per graph (its buffer is consumed by the backward; a second backward through
    the same graph stops with autograd's in-place error)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, spec: VocabShardSpec, counts: List[int], smoothing: bool, accuracy: bool):  # type: ignore[override]
        rank, world = _world(spec.group)
        group, ledgers, V = spec.group, spec.ledgers, spec.vocab_size
        offset = sum(counts[:rank])
        mine = counts[rank]
        sl = slice(offset, offset + mine)
        w = weight.detach()
        h_wait = _gather_rows_async(hidden.detach(), counts, group, ledgers, K.HIDDEN_GATHER)
        y_wait = _gather_rows_async(target.long(), counts, group, ledgers, K.SOFTMAX_STATS)
        z = torch.empty(sum(counts), w.shape[0], dtype=torch.float32, device=hidden.device)
        logits_into(z[sl], hidden.detach(), w)  # while the peers' hidden states arrive
        h_all, y_all = h_wait.wait(), y_wait.wait()
        logits_into(z[:offset], h_all[:offset], w)
        logits_into(z[offset + mine:], h_all[offset + mine:], w)
        col = local_columns(y_all, spec.rows, V)
        loc = local_max(z, spec.rows, V)
        m = _all_reduce(loc.max.clone(), "max", group, ledgers, K.SOFTMAX_STATS)
        parts = [target_logits(z, col)]
        if smoothing:
            parts.append(z.sum(dim=1))
        e = exp_shifted_(z, m)
        sums = _all_reduce(torch.stack([e.sum(dim=1), *parts]), "sum", group, ledgers, K.SOFTMAX_STATS)
        log_z, nll, smooth = losses_from_stats(m, sums, V)
        if accuracy:
            cand = torch.where(loc.max == m, loc.argmax, torch.full_like(loc.argmax, V))
            pred = _all_reduce(cand, "min", group, ledgers, K.SOFTMAX_STATS)
            n_correct = (pred == y_all)[sl].sum()
        else:
            n_correct = torch.zeros((), dtype=torch.long)
        ctx.save_for_backward(h_all, weight, e, sums[0].clone(), col)
        ctx.spec, ctx.counts, ctx.smoothing, ctx.hidden_dtype = spec, list(counts), smoothing, hidden.dtype
        ctx.mark_non_differentiable(n_correct)
        smooth_out = smooth[sl].clone() if smooth is not None else nll.new_zeros(mine)
        return nll[sl].clone(), smooth_out, n_correct

    @staticmethod
    def backward(ctx, g_nll, g_smooth, _g_correct):  # type: ignore[override]
        h_all, weight, e, s, col = ctx.saved_tensors
        spec, counts = ctx.spec, ctx.counts
        rank, world = _world(spec.group)
        mine = counts[rank]
        g_nll = g_nll if g_nll is not None else e.new_zeros(mine)
        cols = [g_nll.float()]
        if ctx.smoothing:
            cols.append(g_smooth.float() if g_smooth is not None else e.new_zeros(mine))
        g = _all_gather_rows(torch.stack(cols, dim=1), counts, spec.group, spec.ledgers, K.SOFTMAX_STATS)
        dz = logits_grad_(e, s, col, g[:, 0], g[:, 1] if ctx.smoothing else None, spec.vocab_size)
        dh_all = (dz @ weight.float()).to(ctx.hidden_dtype)
        # collective on every rank alike, whatever this rank needs; in flight during the
        # weight gradient's product
        dh_wait = _reduce_scatter_rows_async(dh_all, counts, spec.group, spec.ledgers, K.HIDDEN_GRAD)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (dz.t() @ h_all.float()).mul_(spec.grad_scale).to(weight.dtype)
        dh = dh_wait.wait()
        return (dh if ctx.needs_input_grad[0] else None), grad_weight, None, None, None, None, None


@dataclass
class VocabParallelLoss:
    """Per-token losses of this rank's tokens (in the order given) and its correct count."""

    nll: torch.Tensor
    smooth: Optional[torch.Tensor]
    n_correct: torch.Tensor
    counts: List[int]


def vocab_parallel_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    spec: VocabShardSpec,
    *,
    smoothing: bool = False,
    accuracy: bool = False,
    counts: Optional[Sequence[int]] = None,
) -> VocabParallelLoss:
    """Cross entropy (and the smoothing term) of this rank's tokens against the full
    vocabulary, with only this rank's rows of the table. Collective.

    ``hidden`` (``T x D``) and ``target`` (``T``, global ids) are this rank's tokens,
    masked positions already removed; ``counts`` every rank's ``T`` (all-gathered here
    when not given). Gradients flow to ``hidden`` (this rank's tokens) and ``weight``
    (this rank's rows, times ``spec.grad_scale``).
    """
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be T x D and target T, got {tuple(hidden.shape)} and {tuple(target.shape)}")
    if counts is None:
        counts = _gather_counts(hidden.shape[0], spec.group, spec.ledgers)
    counts = list(counts)
    if sum(counts) == 0:  # every rank knows: no collective at all
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0
        empty = zero.reshape(1)[:0].float()
        return VocabParallelLoss(empty, empty if smoothing else None, torch.zeros((), dtype=torch.long), counts)
    nll, smooth, n_correct = VocabParallelCrossEntropy.apply(hidden, weight, target, spec, counts, smoothing, accuracy)
    return VocabParallelLoss(nll, smooth if smoothing else None, n_correct, counts)


def label_smoothed_loss(nll: torch.Tensor, smooth: torch.Tensor, epsilon: float, vocab_size: int) -> torch.Tensor:
    """fairseq's ``label_smoothed_nll_loss`` from the two terms (summed or per token)."""
    eps_i = epsilon / (vocab_size - 1)
    return (1.0 - epsilon - eps_i) * nll + eps_i * smooth


# --------------------------------------------------------------------------- cost and choice


@dataclass(frozen=True)
class OutputCost:
    """Bytes one rank moves in a step for each way of reading the output table."""

    gather_bytes: int
    vocab_parallel_bytes: int
    tokens_max: int

    def choose(self, mode: str = AUTO) -> str:
        if mode in (GATHER, VOCAB_PARALLEL):
            return mode
        return VOCAB_PARALLEL if self.vocab_parallel_bytes < self.gather_bytes else GATHER


def output_bytes(
    vocab_size: int, dim: int, counts: Sequence[int], *, elem_bytes: int = 4, smoothing: bool = True,
    accuracy: bool = False, max_shard_rows: Optional[int] = None,
) -> OutputCost:
    """Bytes sent by the busiest rank per step (as the ledger records them) for the
    gather path (all-gather of the table + reduce-scatter of its gradient) and the
    vocab-parallel path (hidden states, targets, statistics, upstream gradients,
    hidden-state gradients)."""
    world = len(counts)
    if world <= 1:
        return OutputCost(0, 0, int(sum(counts)))
    t, m = max(counts), sum(counts)
    shard = max_shard_rows if max_shard_rows is not None else -(-vocab_size // world)
    smallest = vocab_size // world
    gather = (world - 1) * shard * dim * elem_bytes + (vocab_size - smallest) * dim * elem_bytes
    ring = 2.0 * (world - 1) / world
    k = 3 if smoothing else 2
    vp = (
        (world - 1) * 8  # counts
        + (world - 1) * t * dim * elem_bytes  # hidden states
        + (world - 1) * t * 8  # targets
        + ring * m * 4 * k  # max, then [sum exp, z_y, (sum z)]
        + (ring * m * 8 if accuracy else 0)
        + (world - 1) * t * 4 * (2 if smoothing else 1)  # upstream gradients
        + (world - 1) * t * dim * elem_bytes  # hidden-state gradients (at most)
    )
    return OutputCost(int(gather), int(vp), int(t))


class OutputChooser:
    """Per-step choice between the two paths, logged once and when it changes.

    ``mode``: ``auto`` (cheaper by :func:`output_bytes`), ``vocab-parallel`` or
    ``gather`` (forced). Every rank gives it the same counts, so every rank takes the
    same path.
    """

    def __init__(self, mode: str = AUTO, name: str = "output layer") -> None:
        if mode not in OUTPUT_MODES:
            raise ValueError(f"output mode must be one of {OUTPUT_MODES}, got {mode!r}")
        self.mode, self.name = mode, name
        self.last: Optional[str] = None
        self.last_cost: Optional[OutputCost] = None
        self.steps = {GATHER: 0, VOCAB_PARALLEL: 0}

    def choose(self, cost: OutputCost) -> str:
        choice = cost.choose(self.mode)
        self.steps[choice] += 1
        if choice != self.last:
            logger.info(
                "%s: %s (%s; per rank per step: vocab-parallel %.3f MB, gather %.3f MB, max %d tokens per rank)",
                self.name, choice, "forced" if self.mode != AUTO else "auto",
                cost.vocab_parallel_bytes / 1e6, cost.gather_bytes / 1e6, cost.tokens_max,
            )
        self.last, self.last_cost = choice, cost
        return choice
