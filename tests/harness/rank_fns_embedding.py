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
        # the padding row of the *sharded* table, on the rank that owns it (any layout)
        pad_local = emb._padding_local
        out[case] = {
            "shape_ok": tuple(y.shape) == (*ids.shape, dim),
            "init_diff": init_diff,
            "fwd_diff": (y - y_ref).abs().max().item() if y.numel() else 0.0,
            "grad_diff": (emb.weight.grad - emb.shard_of(g)).abs().max().item() if emb.weight.numel() else 0.0,
            "pad_owner": pad_local is not None,
            "pad_grad": float(emb.weight.grad[pad_local].abs().sum()) if pad_local is not None else 0.0,
            "pad_row": float(emb.weight.detach()[pad_local].abs().sum()) if pad_local is not None else 0.0,
            # what the padding row would get without the zeroing (nonzero: the check can fail)
            "pad_would_get": float((coef * (ids == padding_idx).unsqueeze(-1)).abs().sum()) if padding_idx is not None else 0.0,
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


def _rows_of(emb, full):
    """The rows of ``full`` the rank of ``emb`` must hold, written out per layout (not
    through the plan under test): strided -> ids r, r+N, ...; contiguous -> a range."""
    if emb.plan.layout == "strided":
        return full[emb.rank::emb.world_size]
    return full[slice(*emb.shard_range)]


def checkpoint_reshard(rank, world):
    """A table saved on 2 ranks loads on 3 and on 1; one saved on 3 loads on 2 and on 1
    (3 spawned ranks: the 2- and 1-rank tables live on the groups {0, 1} and {0})."""
    pair, solo = dist.new_group([0, 1]), dist.new_group([0])  # collectives: every rank takes part
    out = {}

    def full_on_all(sd_weight, src_has_it):
        full = sd_weight.clone() if src_has_it else torch.empty(9, 2)
        dist.broadcast(full, 0)
        return full

    # saved on 2 ranks
    saved2 = None
    if rank < 2:
        torch.manual_seed(5)
        a = ShardedEmbedding(9, 2, process_group=pair)
        with torch.no_grad():
            a.weight += 10 * (rank + 1)  # shards distinguishable from any fresh init
        try:
            a.state_dict()
            out["refused_unconsolidated"] = False
        except RuntimeError:
            out["refused_unconsolidated"] = True
        a.consolidate()
        saved2 = a.state_dict()["weight"]
        out["saved_rows"] = saved2.shape[0]
        out["range2"] = a.shard_range
    full2 = full_on_all(saved2 if rank == 0 else None, rank == 0)
    torch.manual_seed(6)
    b = ShardedEmbedding(9, 2)  # 3 ranks
    b.load_state_dict({"weight": full2})
    out["range3"] = b.shard_range
    out["3_from_2_shard"] = bool(torch.equal(b.weight.detach(), _rows_of(b, full2)))
    out["3_from_2_full"] = bool(torch.equal(b.full_weight(), full2))
    if rank == 0:
        torch.manual_seed(7)
        c = ShardedEmbedding(9, 2, process_group=solo)
        c.load_state_dict({"weight": full2})
        out["1_from_2"] = bool(torch.equal(c.weight.detach(), full2)) and not c.is_sharded
    # saved on 3 ranks
    with torch.no_grad():
        b.weight -= 100 * (rank + 1)
    b.consolidate()
    full3 = b.state_dict()["weight"]
    out["3_saved_moved"] = not bool(torch.equal(full3, full2))
    if rank < 2:
        torch.manual_seed(8)
        d = ShardedEmbedding(9, 2, process_group=pair)
        d.load_state_dict({"weight": full3})
        out["2_from_3_shard"] = bool(torch.equal(d.weight.detach(), _rows_of(d, full3)))
        out["2_from_3_full"] = bool(torch.equal(d.full_weight(), full3))
    if rank == 0:
        torch.manual_seed(9)
        e = ShardedEmbedding(9, 2, process_group=solo)
        e.load_state_dict({"weight": full3})
        out["1_from_3"] = bool(torch.equal(e.weight.detach(), full3))
    return out
