"""Per-rank body of the vocab-parallel bias tests (spawned in real gloo ranks): the
replicated bias's gradient by the vocab-parallel path against the full-logits reference."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.tied_projection import BiasedTiedProjection

VOCAB, DIM, TOKENS, HOT = 11, 4, 12, 3  # 11: uneven shards over 2 and 3 ranks; HOT: every token's target


def bias_gradient(rank, world, dtype_name, layout, target_grad):
    """One vocab-parallel step of a biased tied projection in ``dtype``; the loss is scaled
    so that the busiest rank's own bias gradient for id ``HOT`` is ``target_grad`` (fp16:
    40000, so the sum over the ranks passes 65504 and their average does not).

    Returns this rank's bias gradient, the ranks' average of it (the dense all-reduce,
    in float64), and the reference: the average of each rank's gradient of the same
    scaled loss through full logits in float64 (what stock DDP averages)."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    table = ShardedEmbedding(VOCAB, DIM, layout=layout)
    bias = nn.Parameter(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 0.1)
    table.to(dtype)
    bias.data = bias.data.to(dtype)
    full = table.full_weight().double()
    g = torch.Generator().manual_seed(10 + rank)
    hidden = (torch.randn(TOKENS, DIM, generator=g) * 0.1).to(dtype)
    target = torch.full((TOKENS,), HOT, dtype=torch.long)
    target[::4] = torch.randint(0, VOCAB, (TOKENS // 4 + (TOKENS % 4 > 0),), generator=g)

    # reference: this rank's gradient of its tokens' loss through full logits, float64
    b64 = bias.detach().double().requires_grad_(True)
    F.cross_entropy(hidden.double() @ full.t() + b64, target, reduction="sum").backward()
    local = b64.grad
    busiest = collectives.all_reduce(local[HOT].abs().reshape(1).clone(), op="max")
    scale = float(target_grad / busiest)
    reference = collectives.all_reduce(local * scale) / world

    layer = BiasedTiedProjection(table, bias, mode="vocab-parallel")
    layer.enable_vocab_parallel(True)
    h = hidden.clone().requires_grad_(True)
    res = layer(h).loss(h, target, smoothing=False, accuracy=False)
    (res.nll.float().sum() * scale).backward()
    grad = bias.grad
    average = collectives.all_reduce(grad.double()) / world  # the dense all-reduce's average
    return {"grad": grad.double().numpy(), "dtype": str(grad.dtype), "average": average.numpy(),
            "reference": reference.numpy(), "scale": scale}
