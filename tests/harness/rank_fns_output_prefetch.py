"""Per-rank body of the output-prefetch test (spawned in real gloo ranks): which table
exchange a step of an ``auto`` tied output layer issues, counted by its ledger."""
import torch
import torch.nn.functional as F

from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.tied_projection import TiedShardedProjection

VOCAB, DIM = 403, 16  # 403: uneven shards over 2 and 3 ranks


def auto_steps(rank, world, tokens_per_step):
    """Train steps of a tied table with the table overlap on and an ``auto`` output layer,
    the step's token count prefetched before the lookup as the criterion does. Per step:
    the path the loss took, whether the first lookup started the table's gather, and the
    table's all-gather bytes this rank sent (ledger)."""
    torch.manual_seed(0)
    ledger = CommLedger()
    table = ShardedEmbedding(VOCAB, DIM, ledger=ledger, overlap_table=True)
    layer = TiedShardedProjection(table, mode="auto")
    layer.enable_vocab_parallel(True)
    out = []
    for step, tokens in enumerate(tokens_per_step):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, (tokens,), generator=g)
        target = torch.randint(0, VOCAB, (tokens,), generator=g)
        ledger.reset()
        layer.prefetch_token_counts(tokens)
        hidden = torch.tanh(table(ids))
        started_at_lookup = table._pending_gather is not None
        marker = layer(hidden)
        res = marker.loss(hidden, target, smoothing=False, accuracy=False)
        if res is None:
            loss = F.cross_entropy(marker.logits(), target, reduction="sum")
        else:
            loss = res.nll.sum()
        loss.backward()
        table.finish_pending()
        with torch.no_grad():
            table.weight.add_(table.weight.grad, alpha=-0.1)
        table.weight.grad = None
        out.append({"choice": marker.choice, "started_at_lookup": started_at_lookup,
                    "table_gather": ledger.sent.get(K.TABLE_GATHER, 0), "loss": float(loss)})
    return out
