"""Per-rank bodies of the vocab-parallel loss tests (spawned in real gloo ranks)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from embrace_fairseq.core.deferred_grad import DeferredGrads
from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.core.vocab_parallel import (
    VocabShardSpec,
    label_smoothed_loss,
    output_bytes,
    shard_rows,
    vocab_parallel_loss,
)


def _data(world, vocab, dim, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, dim, generator=g)
    hidden = [torch.randn(n, dim, generator=g) * 2 for n in counts]
    target = [torch.randint(0, vocab, (n,), generator=g) for n in counts]
    return table, hidden, target


def _reference(table, hidden, target, eps, scales, world):
    """Single-process full-table reference: every rank's loss, d(own hidden), and the
    data-parallel average of the full table gradients."""
    vocab = table.shape[0]
    W = table.clone().requires_grad_(True)
    out = []
    for q in range(world):
        h = hidden[q].clone().requires_grad_(True)
        lprobs = F.log_softmax(F.linear(h, W), dim=-1)
        nll = -lprobs.gather(1, target[q].unsqueeze(1)).squeeze(1)
        smooth = -lprobs.sum(1)
        loss = label_smoothed_loss(nll.sum(), smooth.sum(), eps, vocab) if eps else nll.sum()
        (loss * scales[q]).backward()
        correct = int((lprobs.argmax(1) == target[q]).sum())
        out.append(dict(loss=loss.item(), nll=nll.sum().item(), dh=h.grad.clone(), correct=correct))
    return out, W.grad / world


def compare_with_full_table(rank, world, vocab, dim, counts, eps, layout="contiguous", defer=False):
    counts = counts[:world]
    table, hidden, target = _data(world, vocab, dim, counts)
    scales = [1.0 + 0.5 * q for q in range(world)]  # a different upstream gradient per rank
    ref, ref_grad = _reference(table, hidden, target, eps, scales, world)

    plan = ShardPlan(vocab, world)
    if layout == "strided":
        rows = torch.arange(rank, vocab, world)
    else:
        rows = shard_rows(*plan.shard_range(rank))
    shard = torch.nn.Parameter(table[rows].clone())
    ledger = CommLedger()
    group = dist.group.WORLD if world > 1 else None
    deferred = DeferredGrads() if defer else None
    spec = VocabShardSpec(rows=rows, vocab_size=vocab, group=group, grad_scale=1.0 / world, ledgers=(ledger,),
                          deferred=deferred)
    h = hidden[rank].clone().requires_grad_(True)
    res = vocab_parallel_loss(h, shard, target[rank], spec, smoothing=bool(eps), accuracy=True)
    nll = res.nll.sum()
    loss = label_smoothed_loss(nll, res.smooth.sum(), eps, vocab) if eps else nll
    (loss * scales[rank]).backward()
    # deferred: the backward left the table's gradient owed, and only that
    owed = (len(deferred), shard.grad is None, h.grad is not None or not counts[rank]) if defer else None
    if defer:
        deferred.flush()
    mine = ref[rank]
    dh = h.grad if h.grad is not None else torch.zeros_like(h)
    return dict(
        loss=abs(loss.item() - mine["loss"]) / max(1.0, abs(mine["loss"])),
        nll=abs(nll.item() - mine["nll"]) / max(1.0, abs(mine["nll"])),
        dh=(dh - mine["dh"]).abs().max().item() if counts[rank] else 0.0,
        dw=(shard.grad - ref_grad[rows]).abs().max().item() if rows.numel() else 0.0,
        correct=(int(res.n_correct), mine["correct"]),
        bytes=ledger.snapshot()["sent"],
        estimate=output_bytes(vocab, dim, counts, smoothing=bool(eps), accuracy=True).vocab_parallel_bytes,
        owed=owed,
    )


def all_empty(rank, world, vocab, dim):
    """No tokens anywhere: no collective, zero loss, gradients defined."""
    rows = shard_rows(*ShardPlan(vocab, world).shard_range(rank))
    shard = torch.nn.Parameter(torch.randn(rows.numel(), dim))
    spec = VocabShardSpec(rows=rows, vocab_size=vocab, group=dist.group.WORLD, grad_scale=1.0 / world)
    h = torch.zeros(0, dim, requires_grad=True)
    res = vocab_parallel_loss(h, shard, torch.zeros(0, dtype=torch.long), spec, smoothing=True)
    res.nll.sum().backward()
    return float(res.nll.sum()), int(res.n_correct)


def compare_cases(rank, world, cases, defer=False):
    """:func:`compare_with_full_table` for each ``(vocab, dim, counts, eps, layout)``, in one
    process group (spawning ranks costs more than the cases)."""
    out = [compare_with_full_table(rank, world, *case, defer=defer) for case in cases]
    if world > 1:
        out.append(all_empty(rank, world, 11, 4))
    return out


def ledger_bytes_per_step(rank, world, vocab, dim, tokens, eps=0.1):
    """Bytes this rank's ledger records for one forward+backward of the output layer by
    each path, through the real modules: a tied ShardedEmbedding read by
    TiedShardedProjection (gather) and by the vocab-parallel marker."""
    from embrace_fairseq.core.ledger import global_ledger
    from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
    from embrace_fairseq.core.tied_projection import TiedShardedProjection

    torch.manual_seed(0)
    table = ShardedEmbedding(vocab, dim)
    out = {}
    for mode in ("gather", "vocab-parallel"):
        layer = TiedShardedProjection(table, mode=mode)
        layer.enable_vocab_parallel(True)
        h = torch.randn(tokens, dim, requires_grad=True)
        y = torch.randint(0, vocab, (tokens,))
        global_ledger().reset()
        result = layer(h)
        if mode == "gather":
            lprobs = F.log_softmax(result.float(), dim=-1)
            loss = -lprobs.gather(1, y.unsqueeze(1)).sum()
        else:
            res = result.loss(h, y, smoothing=bool(eps), accuracy=False)
            loss = label_smoothed_loss(res.nll.sum(), res.smooth.sum(), eps, vocab)
        loss.backward()
        table.finish_pending()
        out[mode] = global_ledger().snapshot()["sent"]
    return out


def prefetched_counts(rank, world, vocab=13, dim=4):
    """The loss through an untied sharded output projection, with the token counts
    gathered by the loss and prefetched before the forward: same counts, same loss and
    gradients; a prefetch that announced another count stops the loss with a message."""
    from embrace_fairseq.core.sharded_output import ShardedOutputProjection

    torch.manual_seed(0)
    layer = ShardedOutputProjection(dim, vocab, mode="vocab-parallel")
    layer.enable_vocab_parallel(True)
    tokens = 3 + 2 * rank
    g = torch.Generator().manual_seed(rank)
    h0, y = torch.randn(tokens, dim, generator=g), torch.randint(0, vocab, (tokens,), generator=g)
    out = {}
    for prefetch in (False, True):
        layer.weight.grad = None
        h = h0.clone().requires_grad_(True)
        if prefetch:
            assert layer.takes_marker
            layer.prefetch_token_counts(tokens)
        marker = layer(h)
        res = marker.loss(h, y, smoothing=True, accuracy=False)
        res.nll.sum().backward()
        out[prefetch] = (res.counts, res.nll.detach(), h.grad.clone(), layer.weight.grad.clone())
    same = out[False][0] == out[True][0] and all(torch.equal(a, b) for a, b in zip(out[False][1:], out[True][1:]))
    layer.prefetch_token_counts(tokens + 1)
    try:
        layer(h0.clone().requires_grad_(True)).loss(h0, y, smoothing=False, accuracy=False)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return out[True][0], same, error
