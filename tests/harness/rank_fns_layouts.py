"""Per-rank bodies of the shard-layout tests (spawned in real gloo ranks)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq import CommLedger, InvalidIdError, ShardedEmbedding
from embrace_fairseq.core.agreement import ShardPlanMismatchError
from embrace_fairseq.optim.optimizer_state import gather_sharded_state, to_local_state, with_full_state

from rank_fns_embedding import _batch, fairseq_style_embedding


def _avg(g, world):
    g = g.clone()
    if world > 1:
        dist.all_reduce(g)
    return g / world


def compare_layout(rank, world, vocab, dim, cases, layout, tied=False):
    """Forward rows, shard gradients and the full table vs a replicated nn.Embedding
    (gradients averaged as DDP does), under ``layout``; ``tied`` adds an output
    projection against the gathered table."""
    out = {}
    for case in cases:
        padding_idx = 1 if case == "padding" else None
        torch.manual_seed(7)
        emb = ShardedEmbedding(vocab, dim, padding_idx=padding_idx, layout=layout)
        torch.manual_seed(7)
        ref = fairseq_style_embedding(vocab, dim, padding_idx)
        owned = emb.vocab_ids()
        ids = _batch(case, rank, world, vocab)
        coef = torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(rank))
        feats = torch.randn(ids.numel(), dim, generator=torch.Generator().manual_seed(100 + rank))
        y, y_ref = emb(ids), ref(ids)
        loss, loss_ref = (y * coef).sum(), (y_ref * coef).sum()
        if tied:
            loss = loss + F.linear(feats, emb.gathered_weight()).square().sum() * 0.01
            loss_ref = loss_ref + F.linear(feats, ref.weight).square().sum() * 0.01
        loss.backward()
        loss_ref.backward()
        emb.finish_pending()
        g = _avg(ref.weight.grad, world)
        out[case] = {
            "shape_ok": tuple(y.shape) == (*ids.shape, dim),
            "owned": owned.tolist(),
            "init_diff": (emb.weight.detach() - ref.weight.detach()[owned]).abs().max().item() if owned.numel() else 0.0,
            "fwd_diff": (y - y_ref).abs().max().item() if y.numel() else 0.0,
            "grad_diff": (emb.weight.grad - g[owned]).abs().max().item() if owned.numel() else 0.0,
            "pad_grad": float(emb.weight.grad[emb._padding_local].abs().sum()) if emb._padding_local is not None else 0.0,
            "full_diff": (emb.full_weight() - ref.weight.detach()).abs().max().item(),
        }
    return out


def adam_steps(rank, world, vocab, dim, layout, steps=3):
    """Adam on the shards vs Adam on a replicated table: updated table and moments."""
    torch.manual_seed(3)
    emb = ShardedEmbedding(vocab, dim, padding_idx=1, layout=layout)
    ref = nn.Parameter(emb.full_weight())
    opt, opt_ref = torch.optim.Adam(emb.parameters(), lr=0.1), torch.optim.Adam([ref], lr=0.1)
    for step in range(steps):
        ids = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(rank * 10 + step))
        opt.zero_grad()
        opt_ref.zero_grad()
        emb(ids).pow(2).sum().backward()
        F.embedding(ids, ref, padding_idx=1).pow(2).sum().backward()
        ref.grad = _avg(ref.grad, world)
        opt.step()
        opt_ref.step()
    full = gather_sharded_state(opt)[0]
    st = opt_ref.state[ref]
    return {
        "table": (emb.full_weight() - ref.detach()).abs().max().item(),
        "exp_avg": (full["exp_avg"] - st["exp_avg"]).abs().max().item(),
        "exp_avg_sq": (full["exp_avg_sq"] - st["exp_avg_sq"]).abs().max().item(),
    }


def bytes_of_one_step(rank, world, vocab, dim, layout, ids_per_rank):
    ledger = CommLedger()
    emb = ShardedEmbedding(vocab, dim, layout=layout, ledger=ledger)
    emb(ids_per_rank[rank]).sum().backward()
    s = ledger.snapshot()
    return {k: (s["sent"].get(k, 0), s["received"].get(k, 0)) for k in ("rows", "grad_rows")}


def bad_id(rank, world, layout, bad_rank, bad_value):
    emb = ShardedEmbedding(11, 4, layout=layout)
    ids = torch.tensor([1, bad_value, 3]) if rank == bad_rank else torch.tensor([1, 2, 3])
    try:
        emb(ids)
    except InvalidIdError as e:
        return ("raised", str(e))
    return ("ok", "")


def mismatched_layouts(rank, world):
    try:
        ShardedEmbedding(12, 3, layout="contiguous" if rank == 1 else "strided")
    except ShardPlanMismatchError as e:
        return ("raised", str(e))
    return ("ok", "")


def relayout(rank, world, vocab, dim):
    """set_layout keeps the full table (and the parameter), changes the owners."""
    torch.manual_seed(4)
    emb = ShardedEmbedding(vocab, dim, padding_idx=1, layout="contiguous")
    before = emb.full_weight()
    param = emb.weight
    emb.set_layout("strided")
    ids = torch.arange(vocab).view(1, -1)
    return {
        "same_param": emb.weight is param,
        "full": (emb.full_weight() - before).abs().max().item(),
        "lookup": (emb(ids)[0] - before).abs().max().item(),
        "layout": emb.layout,
        "owned": emb.vocab_ids().tolist(),
    }


def save_sharded(rank, world, vocab, dim, layout, path):
    """A few Adam steps, then a world-size independent checkpoint (rank 0 writes it)."""
    torch.manual_seed(11)
    emb = ShardedEmbedding(vocab, dim, padding_idx=1, layout=layout)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    for step in range(3):
        ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(rank * 7 + step))
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()
    emb.consolidate()
    full_state = gather_sharded_state(opt)
    model = emb.state_dict()
    optim = with_full_state(opt.state_dict(), full_state)
    if rank == 0:
        torch.save({"model": model, "optim": optim}, path)
    if world > 1:
        dist.barrier()
    # numpy: tensors returned from a rank that has exited cannot be rebuilt
    return {"table": model["weight"].numpy().copy(), "exp_avg": full_state[0]["exp_avg"].numpy().copy(),
            "exp_avg_sq": full_state[0]["exp_avg_sq"].numpy().copy()}


def load_sharded(rank, world, vocab, dim, layout, path):
    """Load the checkpoint under another layout / world size, gather it back, step once."""
    ck = torch.load(path, map_location="cpu")
    torch.manual_seed(99)  # another initial table: everything must come from the checkpoint
    emb = ShardedEmbedding(vocab, dim, padding_idx=1, layout=layout)
    emb.load_state_dict(ck["model"])
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    opt.load_state_dict(to_local_state(ck["optim"], opt))
    st = opt.state[emb.weight]
    owned = emb.vocab_ids()
    local_ok = bool(torch.equal(emb.weight.detach(), ck["model"]["weight"][owned])) and bool(
        torch.equal(st["exp_avg"], ck["optim"]["state"][0]["exp_avg"][owned]))
    full_state = gather_sharded_state(opt).get(0, st)  # one rank: the state is the full table
    return {"table": emb.full_weight().detach().numpy().copy(), "exp_avg": full_state["exp_avg"].numpy().copy(),
            "exp_avg_sq": full_state["exp_avg_sq"].numpy().copy(), "local_ok": local_ok}



def _deepspeed_layout_train(rank, steps, embrace, built_layout):
    import rank_fns_deepspeed as D
    from embrace_fairseq.deepspeed_adapter import initialize

    model = D.TinyLM(True, True)
    if built_layout != model.emb.layout:
        torch.manual_seed(1234)  # the table TinyLM draws first, under the other layout
        model.emb = ShardedEmbedding(D.VOCAB, D.DIM, padding_idx=1, layout=built_layout)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = initialize(model=model, optimizer=opt, config=D._ds_config(1, embrace=embrace))
    losses = []
    for step in range(steps):
        ids, tgt = D._batch(step, rank)
        loss = engine(ids, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.embrace.close()
    return {"layout": model.emb.layout, "owned": model.emb.vocab_ids().tolist(), "losses": losses,
            "state": model.full_state()}


VARIANTS = [("strided", {"shard_layout": "contiguous"}, "contiguous"),
            ("contiguous", {}, "contiguous"),
            ("contiguous", {"shard_layout": "strided"}, "strided")]


def deepspeed_layouts_run(rank, world, steps):
    """Stock DeepSpeed (replicated table) and EmbRace engines whose tables were built with
    one layout and whose "embrace" section may ask for another (:data:`VARIANTS`)."""
    import rank_fns_deepspeed as D

    D._ds_env(rank, world)
    torch.set_num_threads(1)
    out = {"ref": D.train(rank, world, sharded=False, tied=True, steps=steps)}
    for i, (built, embrace, _) in enumerate(VARIANTS):
        out[i] = _deepspeed_layout_train(rank, steps, embrace, built)
    return out
