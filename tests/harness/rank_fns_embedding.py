"""Per-rank bodies of the ShardedEmbedding tests (spawned in real gloo ranks)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from embrace_fairseq import CommLedger, InvalidIdError, ShardedEmbedding, fairseq_initial_table


def fairseq_style_embedding(vocab, dim, padding_idx):
    """What fairseq.models.transformer.Embedding() does, written out independently."""
    m = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=dim**-0.5)
    if padding_idx is not None:
        nn.init.constant_(m.weight[padding_idx], 0)
    return m


def _batch(case, rank, world, vocab):
    g = torch.Generator().manual_seed(1000 + rank)
    if case == "empty_rank" and rank == world - 1:
        return torch.zeros(0, 5, dtype=torch.long)
    if case == "one_shard":
        return torch.randint(0, max(1, vocab // world), (3, 5), generator=g)
    ids = torch.randint(0, vocab, (3, 5), generator=g)
    if case == "repeats":
        ids[:, 1:] = ids[:, :1]  # many repeats of a few ids
    if case == "padding":
        ids[0, :2] = 1  # padding_idx used by the test
    return ids


def compare_with_replicated(rank, world, vocab, dim, cases):
    """Forward rows and shard grads vs a replicated nn.Embedding with averaged grads."""
    out = {}
    for case in cases:
        padding_idx = 1 if case == "padding" else None
        torch.manual_seed(7)
        emb = ShardedEmbedding(vocab, dim, padding_idx=padding_idx)
        torch.manual_seed(7)
        ref = fairseq_style_embedding(vocab, dim, padding_idx)
        # fairseq's initialiser, same seed: shard == rows of the replicated table
        init_diff = (emb.weight.detach() - emb.shard_of(ref.weight.detach())).abs().max().item() if emb.weight.numel() else 0.0
        ids = _batch(case, rank, world, vocab)
        coef = torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(rank))
        y = emb(ids)
        y_ref = ref(ids)
        (y * coef).sum().backward()
        (y_ref * coef).sum().backward()
        g = ref.weight.grad.clone()
        if world > 1:
            dist.all_reduce(g)
        g /= world
        out[case] = {
            "shape_ok": tuple(y.shape) == (*ids.shape, dim),
            "init_diff": init_diff,
            "fwd_diff": (y - y_ref).abs().max().item() if y.numel() else 0.0,
            "grad_diff": (emb.weight.grad - emb.shard_of(g)).abs().max().item() if emb.weight.numel() else 0.0,
            "pad_grad": float(g[padding_idx].abs().sum()) if padding_idx is not None else 0.0,
            "full_diff": (emb.full_weight() - ref.weight.detach()).abs().max().item(),
        }
    return out


def optimizer_step(rank, world, vocab, dim, opt_name):
    torch.manual_seed(3)
    emb = ShardedEmbedding(vocab, dim)
    ref = nn.Parameter(emb.full_weight())
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    }[opt_name]
    opt, opt_ref = make(emb.parameters()), make([ref])
    for step in range(3):
        ids = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(rank * 10 + step))
        opt.zero_grad()
        opt_ref.zero_grad()
        emb(ids).pow(2).sum().backward()
        torch.nn.functional.embedding(ids, ref).pow(2).sum().backward()
        if world > 1:
            dist.all_reduce(ref.grad)
        ref.grad /= world
        opt.step()
        opt_ref.step()
    return (emb.weight.detach() - emb.shard_of(ref.detach())).abs().max().item() if emb.weight.numel() else 0.0


def fixed_batch_bytes(rank, world):
    ledger = CommLedger()
    emb = ShardedEmbedding(10, 4, ledger=ledger, layout="contiguous")  # the test counts by hand
    ids = torch.tensor([[1, 2, 2], [7, 0, 0]]) if rank == 0 else torch.tensor([5, 6, 3])
    emb(ids).sum().backward()
    return ledger.snapshot()


def shared_exchange(rank, world):
    """Two lookups through one exchange equal two separate lookups."""
    torch.manual_seed(0)
    emb = ShardedEmbedding(13, 3, padding_idx=0)
    a = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(rank))
    b = torch.randint(0, 13, (3,), generator=torch.Generator().manual_seed(50 + rank))
    ledger = CommLedger()
    emb.ledger = ledger
    emb.prefetch(a, b)
    ya, yb = emb(a), emb(b)
    joint_calls = ledger.calls["ids"]
    (ya.sum() + 2 * yb.sum()).backward()
    g_joint = emb.weight.grad.clone()
    emb.weight.grad = None
    ya2, yb2 = emb(a), emb(b)
    (ya2.sum() + 2 * yb2.sum()).backward()
    return {
        "joint_calls": joint_calls,
        "separate_calls": ledger.calls["ids"] - joint_calls,
        "fwd": max((ya - ya2).abs().max().item(), (yb - yb2).abs().max().item()),
        "grad": (g_joint - emb.weight.grad).abs().max().item() if emb.weight.numel() else 0.0,
    }


def bad_id(rank, world, bad_rank, bad_value):
    emb = ShardedEmbedding(11, 4)
    ids = torch.tensor([1, 2, 3])
    if rank == bad_rank:
        ids = torch.tensor([1, bad_value, 3])
    try:
        emb(ids)
    except InvalidIdError as e:
        return ("raised", str(e))
    return ("ok", "")


def checkpoint_roundtrip(rank, world):
    torch.manual_seed(5)
    emb = ShardedEmbedding(9, 2)
    emb.weight.data += rank  # make shards distinguishable
    try:
        emb.state_dict()
        refused = False
    except RuntimeError:
        refused = True
    emb.consolidate()
    sd = emb.state_dict()
    other = ShardedEmbedding(9, 2)
    other.load_state_dict(sd)
    return {
        "refused_unconsolidated": refused,
        "full_rows": sd["weight"].shape[0],
        "same": bool(torch.equal(other.weight, emb.weight)),
    }
