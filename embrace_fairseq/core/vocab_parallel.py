"""Vocab-parallel output projection and loss inside data parallelism.

Each rank ``r`` of the data-parallel group keeps its rows ``S_r`` of the output table
``W`` (``V x D``; the tied embedding's own shard, or a sharded untied projection) and
has its own ``T_r`` target positions with hidden states ``H_r``. One step
(docs/DESIGN.md, "Vocab-parallel output layer"):

1. all-gather ``H`` and the targets (one all-gather when every rank has as many
   tokens; otherwise an AlltoAll that sends each rank's rows once, unpadded, since
   gloo's and NCCL's all-gathers need equal sizes); ``M = sum T_r`` tokens;
2. local logits ``Z_r = H W[S_r]^T``: ``M x |S_r|``, never ``M x V``;
3. per token, this shard's statistics: its local max ``m_r``, ``s_r = sum exp(z - m_r)``
   over its columns, the target's logit ``z_y`` where it owns the target (else 0), for
   label smoothing the sum of its logits, for accuracy its local argmax; the logits
   buffer now holds the numerators ``exp(z - m_r)``;
4. one AlltoAll sends each token's statistics to the token's owner, which combines
   them: ``m = max_r m_r``, ``logZ = m + log sum_r s_r exp(m_r - m)`` (the merge of
   partial softmax sums: no separate max round), ``nll = logZ - z_y``,
   ``smooth = V logZ - sum_v z_v``, and the argmax over the full vocabulary (the
   smallest id among the ranks whose local max is the global one: the first index on
   ties, as ``argmax`` does); each rank returns its own tokens' ``nll`` and ``smooth``.

Backward: the upstream per-token gradients and ``logZ`` of every token are
all-gathered (``M x 2`` or ``M x 3`` floats) while the rank computes ``Q = E W[S_r]``
from the kept numerators ``E`` (the largest product, which needs neither). With
``p = E exp(m_r - logZ)`` per token and ``a = g_nll + V g_smooth``,
``dZ = g_nll (p - onehot_y) + g_smooth (V p - 1)`` is never formed: the hidden
gradient is ``a exp(m_r - logZ) Q - g_nll W[y] - g_smooth sum_v W[v]`` (rows of
``Q`` scaled, owned targets' rows, a column sum), summed over ranks and scattered
back to the tokens' owners (an AlltoAll plus a local sum, no padding) while the rank
computes the table's gradient ``E^T (a exp(m_r - logZ) H) - onehot^T (g_nll H) -
sum_t g_smooth H`` times ``grad_scale`` (``1/N``: the data-parallel average convention
of the sharded tables), which stays on its rank.

Deferred table gradient (``spec.deferred``): the backward returns the hidden-state
gradient and hands the table's gradient product (as large as ``Q``) to a
:class:`~.deferred_grad.DeferredGrads`, computed when the table's pending work is
finished (``ShardedEmbedding.finish_pending``, before the optimizer step). The layers below
then run their backward, and their dense gradients go on the wire, one large product
earlier; the product runs while the dense all-reduce is in flight instead of before
it starts (Megatron-LM defers its output layer's weight gradient the same way).
Columns that are not the table's (``extra``: a replicated bias's rows) keep their
gradient in the backward: they are dense parameters, all-reduced with the others.

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
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.deferred_grad import DeferredGrads
from embrace_fairseq.core.ledger import CommLedger, record_all
from embrace_fairseq.core.trace import mark_start, record_overlapped, wait_point

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


@dataclass
class PrefetchedCounts:
    """Every rank's token count, gathered ahead of the loss (:func:`prefetch_counts`)."""

    inflight: "_InFlight"

    def wait(self) -> List[int]:
        return [int(c) for c in self.inflight.wait().reshape(-1).tolist()]


def prefetch_counts(tokens: Union[int, torch.Tensor], group, ledgers: Sequence[CommLedger]) -> PrefetchedCounts:
    """Every rank's token count, asynchronously: issued by whoever knows the count before
    the forward (the criterion, from the sample), waited for at the loss, so the loss
    does not stop to gather it. ``tokens``: an int, or a one-element integer tensor on
    any device (counted there: no host synchronisation before the forward). Collective."""
    rank, world = _world(group)
    t = tokens.reshape(1).long() if torch.is_tensor(tokens) else torch.tensor([int(tokens)], dtype=torch.long)
    return PrefetchedCounts(_gather_rows_async(t, [1] * world, group, ledgers, K.SOFTMAX_STATS))


def _scatter_stats(stats: torch.Tensor, counts: Sequence[int], group, ledgers) -> torch.Tensor:
    """Each token's statistics to the token's owner: ``world x counts[rank] x k``."""
    rank, world = _world(group)
    if world == 1:
        return stats.unsqueeze(0)
    row = stats.shape[1] * stats.element_size()
    mark_start(list(ledgers))
    blocks = collectives.scatter_token_rows(stats, counts, group)
    record_all(ledgers, K.SOFTMAX_STATS, (sum(counts) - counts[rank]) * row, (world - 1) * counts[rank] * row)
    return blocks


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
        waited = wait_point(self.pending.device)  # on the collective's clock (core/trace.py)
        out = self.pending.wait()
        record_overlapped(list(self.ledgers), self.kind, self.sent, self.received, self.pending, waited)
        return out


def _gather_rows_async(x: torch.Tensor, counts: Sequence[int], group, ledgers, kind: str) -> _InFlight:
    """Rows of every rank, in rank order (``sum(counts)`` rows), issued now and waited
    for later: an all-gather when the counts are equal, else the unpadded AlltoAll (the
    same rows on the wire, no padding)."""
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


def local_columns(target: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Column of each target inside the local shard (``-1`` where another rank owns it).

    ``rows`` ascend (:class:`VocabShardSpec`), so a binary search finds each target's
    column: no map as long as the vocabulary is built per step (2 MB of int64 at 250k).

    >>> local_columns(torch.tensor([5, 2, 8, 0]), torch.tensor([2, 5, 8]))
    tensor([ 1,  0,  2, -1])
    """
    t = target.long()
    rows = rows.to(t.device)
    if rows.numel() == 0:  # an empty shard (fewer rows than ranks)
        return torch.full_like(t, -1)
    col = torch.searchsorted(rows, t).clamp_(max=rows.numel() - 1)
    return torch.where(rows[col] == t, col, torch.full_like(col, -1))


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
    """``z_y`` per token where this shard owns the target, else 0 (a clamped gather and a
    select: no host sync, where ``nonzero`` waited for the device)."""
    if z.shape[1] == 0:
        return z.new_zeros(z.shape[0])
    zy = z.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(col >= 0, zy, zy.new_zeros(()))


def shard_stats_(z: torch.Tensor, col: torch.Tensor, rows: torch.Tensor, vocab_size: int, *,
                 smoothing: bool, accuracy: bool) -> torch.Tensor:
    """This shard's per-token statistics, ``M x k`` float32: local max ``m_r``,
    ``sum exp(z - m_r)``, the target's logit where the shard owns the target (else 0),
    then with ``smoothing`` the sum of the logits and with ``accuracy`` the global id
    of the local argmax (its int32 bits: the id travels exactly). Overwrites ``z`` in
    place with the numerators ``exp(z - m_r)`` (each at most 1), all the backward needs
    of the logits."""
    loc = local_max(z, rows, vocab_size)
    z_y = target_logits(z, col)
    z_sum = z.sum(dim=1) if smoothing else None  # read before the logits are overwritten
    if z.shape[1]:
        z.sub_(loc.max.unsqueeze(1)).exp_()
    cols = [loc.max, z.sum(dim=1), z_y]
    if smoothing:
        cols.append(z_sum)
    if accuracy:
        cols.append(loc.argmax.to(torch.int32).view(torch.float32))
    return torch.stack(cols, dim=1)


@dataclass
class TokenLosses:
    """This rank's tokens' values, combined from every shard's statistics."""

    log_z: torch.Tensor
    nll: torch.Tensor
    smooth: Optional[torch.Tensor]  # ``-sum_v log p_v`` (label smoothing)
    pred: Optional[torch.Tensor]  # argmax over the full vocabulary (accuracy)


def combine_stats(blocks: torch.Tensor, vocab_size: int, *, smoothing: bool, accuracy: bool) -> TokenLosses:
    """Per token, from every shard's :func:`shard_stats_` (``world x T x k``):
    ``logZ = m + log sum_r s_r exp(m_r - m)`` with ``m = max_r m_r`` (an empty shard's
    ``m_r = -inf`` adds 0), ``nll = logZ - z_y``, ``smooth = V logZ - sum_v z_v``, and
    the smallest id among the shards whose local max is ``m``."""
    m_r = blocks[..., 0]
    m = m_r.max(dim=0).values
    log_z = m + torch.log((blocks[..., 1] * torch.exp(m_r - m)).sum(dim=0))
    nll = log_z - blocks[..., 2].sum(dim=0)
    smooth = vocab_size * log_z - blocks[..., 3].sum(dim=0) if smoothing else None
    pred = None
    if accuracy:
        ids = blocks[..., -1].contiguous().view(torch.int32).long()
        pred = torch.where(m_r == m, ids, torch.full_like(ids, vocab_size)).min(dim=0).values
    return TokenLosses(log_z, nll, smooth, pred)


def hidden_grad(q: torch.Tensor, weight: torch.Tensor, col: torch.Tensor, coef: torch.Tensor,
                g_nll: torch.Tensor, g_smooth: Optional[torch.Tensor]) -> torch.Tensor:
    """``dZ W[S_r]`` for ``dZ = g_nll (p - onehot_y) + g_smooth (V p - 1)`` without
    forming ``dZ``: ``coef Q - g_nll W[y] - g_smooth sum_v W[v]``, where ``Q = E W[S_r]``
    and ``coef = (g_nll + V g_smooth) exp(m_r - logZ)`` (``p = E exp(m_r - logZ)``).
    Overwrites ``q``."""
    dh = q.mul_(coef.unsqueeze(1))
    if weight.shape[0]:  # every token's row (clamped), zero where another shard owns y
        owned = (col >= 0).unsqueeze(1)
        dh -= torch.where(owned, g_nll.unsqueeze(1) * weight[col.clamp(min=0)], 0.0)
    if g_smooth is not None:
        dh -= g_smooth.unsqueeze(1) * weight.sum(dim=0).unsqueeze(0)
    return dh


def weight_grad(e: torch.Tensor, hidden: torch.Tensor, col: torch.Tensor, coef: torch.Tensor,
                g_nll: torch.Tensor, g_smooth: Optional[torch.Tensor]) -> torch.Tensor:
    """``dZ^T H`` for the same ``dZ`` (:func:`hidden_grad`), from the numerators ``E``:
    ``E^T (coef H) - onehot_y^T (g_nll H) - sum_t g_smooth H`` (the last on every row)."""
    gw = e.t() @ (hidden * coef.unsqueeze(1))
    if gw.shape[0]:  # tokens of other shards add zeros (to row 0)
        owned = (col >= 0).unsqueeze(1)
        gw.index_add_(0, col.clamp(min=0), torch.where(owned, hidden * -g_nll.unsqueeze(1), 0.0))
    if g_smooth is not None:
        gw -= (g_smooth @ hidden).unsqueeze(0)
    return gw


# --------------------------------------------------------------------------- autograd


@dataclass
class VocabShardSpec:
    """What the function needs to know about the sharded table besides its weight."""

    rows: torch.Tensor  # global ids of the local rows, in the weight's row order: ascending (both layouts')
    vocab_size: int
    group: object = None
    grad_scale: float = 1.0  # on the shard's gradient: 1/N for the data-parallel average
    extra_scale: Optional[float] = None  # on the extra columns' gradient; None: grad_scale
    ledgers: Tuple[CommLedger, ...] = ()
    deferred: Optional[DeferredGrads] = None  # set: the table's gradient is computed there, later


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``(hidden T x (D + k), weight shard |S_r| x D, extra |S_r| x k or None, target T)``
    -> ``(nll T, smooth T, n_correct)`` for this rank's tokens, computed against every
    rank's shard (``extra``: more columns of it, e.g. a bias's rows against a column of
    ones in ``hidden``). Collective: in
    forward two asynchronous gathers (hidden states, targets) and one blocking
    AlltoAll (the statistics); in backward one asynchronous gather (upstream
    gradients and ``logZ``) and one asynchronous reduce-scatter (hidden gradients).

    Overlap: the hidden states' all-gather is in flight while this rank computes its
    own tokens' logits; the upstream gradients' gather while it computes ``E W[S_r]``;
    the reduce-scatter of the hidden-state gradients while it computes the shard's
    weight gradient (unless it is deferred: ``spec.deferred``). The logits are overwritten
    by their softmax numerators: one ``M x V/N`` buffer and one ``exp`` per step, which
    the backward only reads."""

    @staticmethod
    def forward(ctx, hidden, weight, extra, target, spec: VocabShardSpec, counts: List[int], smoothing: bool, accuracy: bool):  # type: ignore[override]
        rank, world = _world(spec.group)
        group, ledgers, V = spec.group, spec.ledgers, spec.vocab_size
        offset = sum(counts[:rank])
        mine = counts[rank]
        sl = slice(offset, offset + mine)
        w = weight.detach() if extra is None else torch.cat([weight.detach(), extra.detach().to(weight.dtype)], dim=1)
        h_wait = _gather_rows_async(hidden.detach(), counts, group, ledgers, K.HIDDEN_GATHER)
        y_wait = _gather_rows_async(target.long(), counts, group, ledgers, K.SOFTMAX_STATS)
        z = torch.empty(sum(counts), w.shape[0], dtype=torch.float32, device=hidden.device)
        logits_into(z[sl], hidden.detach(), w)  # while the peers' hidden states arrive
        h_all, y_all = h_wait.wait(), y_wait.wait()
        logits_into(z[:offset], h_all[:offset], w)
        logits_into(z[offset + mine:], h_all[offset + mine:], w)
        col = local_columns(y_all, spec.rows)
        stats = shard_stats_(z, col, spec.rows, V, smoothing=smoothing, accuracy=accuracy)  # z <- E
        own = combine_stats(_scatter_stats(stats, counts, group, ledgers), V, smoothing=smoothing, accuracy=accuracy)
        if accuracy:
            n_correct = (own.pred == target.long()).sum()
        else:
            n_correct = torch.zeros((), dtype=torch.long)
        ctx.save_for_backward(h_all, w, z, stats[:, 0].clone(), col, own.log_z)
        ctx.spec, ctx.counts, ctx.smoothing, ctx.hidden_dtype = spec, list(counts), smoothing, hidden.dtype
        # deferred only into a parameter's own .grad (what autograd would accumulate)
        ctx.table = weight if spec.deferred is not None and ctx.needs_input_grad[1] and weight.is_leaf else None
        ctx.table_cols, ctx.extra_dtype = weight.shape[1], (extra.dtype if extra is not None else None)
        ctx.mark_non_differentiable(n_correct)
        smooth_out = own.smooth if smoothing else own.nll.new_zeros(mine)
        return own.nll, smooth_out, n_correct

    @staticmethod
    def backward(ctx, g_nll, g_smooth, _g_correct):  # type: ignore[override]
        h_all, weight, e, m_local, col, log_z = ctx.saved_tensors
        spec, counts = ctx.spec, ctx.counts
        rank, world = _world(spec.group)
        mine = counts[rank]
        cols = [g_nll.float() if g_nll is not None else e.new_zeros(mine)]
        if ctx.smoothing:
            cols.append(g_smooth.float() if g_smooth is not None else e.new_zeros(mine))
        cols.append(log_z)
        g_wait = _gather_rows_async(torch.stack(cols, dim=1), counts, spec.group, spec.ledgers, K.SOFTMAX_STATS)
        w = weight.float()
        q = e @ w  # the largest product needs no peer: it runs while the gradients arrive
        g = g_wait.wait()
        g_n, g_s = g[:, 0], (g[:, 1] if ctx.smoothing else None)
        coef = torch.exp(m_local - g[:, -1])  # p = E exp(m_r - logZ)
        coef.mul_(g_n if g_s is None else g_n + spec.vocab_size * g_s)
        dh_all = hidden_grad(q, w, col, coef, g_n, g_s).to(ctx.hidden_dtype)
        # collective on every rank alike, whatever this rank needs; in flight during the
        # weight gradient's product
        dh_wait = _reduce_scatter_rows_async(dh_all, counts, spec.group, spec.ledgers, K.HIDDEN_GRAD)
        grad_weight, grad_extra = _weight_grads(ctx, e, h_all, col, coef, g_n, g_s, weight.dtype)
        dh = dh_wait.wait()
        return (dh if ctx.needs_input_grad[0] else None), grad_weight, grad_extra, None, None, None, None, None


def _weight_grads(ctx, e: torch.Tensor, h_all: torch.Tensor, col: torch.Tensor, coef: torch.Tensor,
                  g_n: torch.Tensor, g_s: Optional[torch.Tensor], dtype: torch.dtype):
    """The gradients of the table's columns and of the extra ones, times ``grad_scale``;
    the table's handed to ``spec.deferred`` (None returned) when set."""
    spec, d = ctx.spec, ctx.table_cols
    want_table, want_extra = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    # each scaled in float32, before its one rounding to a half dtype
    extra_scale = spec.grad_scale if spec.extra_scale is None else spec.extra_scale
    h = h_all.float()
    if ctx.table is None:  # both now, in one product
        if not (want_table or want_extra):
            return None, None
        gw = weight_grad(e, h, col, coef, g_n, g_s)
        gw[:, :d].mul_(spec.grad_scale)
        gw[:, d:].mul_(extra_scale)
        return ((gw[:, :d].to(dtype) if want_table else None),
                (gw[:, d:].to(ctx.extra_dtype) if want_extra else None))
    grad_extra = None
    if want_extra:  # a dense parameter's: its all-reduce must not wait for the deferral
        grad_extra = weight_grad(e, h[:, d:], col, coef, g_n, g_s).mul_(extra_scale).to(ctx.extra_dtype)
    table_h = h[:, :d]

    def table_grad() -> torch.Tensor:
        return weight_grad(e, table_h, col, coef, g_n, g_s).mul_(spec.grad_scale).to(dtype)

    spec.deferred.defer(ctx.table, table_grad)
    return None, grad_extra


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
    extra: Optional[torch.Tensor] = None,
) -> VocabParallelLoss:
    """Cross entropy (and the smoothing term) of this rank's tokens against the full
    vocabulary, with only this rank's rows of the table. Collective.

    ``hidden`` (``T x D``) and ``target`` (``T``, global ids) are this rank's tokens,
    masked positions already removed; ``counts`` every rank's ``T`` (all-gathered here
    when not given). ``extra`` (``|S_r| x k``): more columns of the shard, against the
    last ``k`` of ``hidden`` (``T x (D + k)``). Gradients flow to ``hidden`` (this
    rank's tokens), ``weight`` and ``extra`` (this rank's rows, times ``spec.grad_scale``;
    ``weight``'s through ``spec.deferred`` when set).
    """
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be T x D and target T, got {tuple(hidden.shape)} and {tuple(target.shape)}")
    k = 0 if extra is None else extra.shape[1]
    if hidden.shape[1] != weight.shape[1] + k or (extra is not None and extra.shape[0] != weight.shape[0]):
        raise ValueError(f"hidden of width {hidden.shape[1]} against a shard of {tuple(weight.shape)} and extra "
                         f"columns {None if extra is None else tuple(extra.shape)}")
    if counts is None:
        counts = _gather_counts(hidden.shape[0], spec.group, spec.ledgers)
    counts = list(counts)
    if sum(counts) == 0:  # every rank knows: no collective at all
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0 + (extra.sum() * 0.0 if extra is not None else 0.0)
        empty = zero.reshape(1)[:0].float()
        return VocabParallelLoss(empty, empty if smoothing else None, torch.zeros((), dtype=torch.long), counts)
    nll, smooth, n_correct = VocabParallelCrossEntropy.apply(hidden, weight, extra, target, spec, counts, smoothing,
                                                             accuracy)
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
    k = 3 + int(smoothing) + int(accuracy)  # per-token statistics: m_r, s_r, z_y, (sum z), (argmax)
    row = dim * elem_bytes

    def sent(mine: int) -> float:  # by a rank with ``mine`` tokens
        return (
            (world - 1) * 8  # its count
            + (world - 1) * mine * (row + 8)  # its hidden states and targets to every peer
            + (m - mine) * 4 * k  # statistics of the others' tokens to their owners
            + (world - 1) * mine * 4 * (3 if smoothing else 2)  # upstream gradients and logZ
            + (m - mine) * row  # hidden-state gradients of the others' tokens
        )

    vp = max(sent(c) for c in counts)
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
