"""Per-rank bodies of the DeepSpeed fault scenarios (real gloo ranks, real engines)."""
import os
import signal
import time

import torch

from rank_fns_deepspeed import PIECES, TinyLM, _batch, _ds_config, _ds_env


def _engine(embrace, tied=True, lr=1e-2):
    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(sharded=True, tied=tied)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    engine, *_ = initialize(model=model, optimizer=opt, config=_ds_config(1, embrace=embrace))
    return engine, model


def mismatched_config(rank, world, bad_rank):
    """Rank ``bad_rank`` starts with another "embrace" section (another piece size):
    its collective schedule differs, which must stop start-up on every rank."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    cfg = dict(PIECES)
    if rank == bad_rank:
        cfg["piece_bytes"] = PIECES["piece_bytes"] * 4
    t0 = time.monotonic()
    try:
        _engine(cfg)
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        return (type(e).__name__, str(e), time.monotonic() - t0)
    return ("ok", "", time.monotonic() - t0)


def rank_dies(rank, world, victim, at, mark):
    """Train; rank ``victim`` SIGKILLs itself after the forward of step ``at``."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    engine, _ = _engine(dict(PIECES))
    for step in range(10_000):
        ids, tgt = _batch(step, rank)
        loss = engine(ids, tgt)
        if rank == victim and step == at:
            with open(mark, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()
    return "finished"


def inf_in_shard_gradient(rank, world, bad_rank, at, steps=6):
    """inf in rank ``bad_rank``'s shard gradient at step ``at`` (after backward, before step)."""
    from embrace_fairseq.guards.replica_check import check_replicas_agree, dense_digest

    _ds_env(rank, world)
    torch.set_num_threads(1)
    engine, model = _engine(dict(PIECES))
    digest_before = None
    for step in range(steps):
        ids, tgt = _batch(step, rank)
        loss = engine(ids, tgt)
        engine.backward(loss)
        if step == at:
            digest_before = dense_digest(model)
            if rank == bad_rank:
                model.emb.weight.grad.view(-1)[0] = float("inf")
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            check_replicas_agree(model)
            return {"step": step, "error": (type(e).__name__, str(e)), "unchanged": dense_digest(model) == digest_before,
                    "table_finite": bool(torch.isfinite(model.emb.full_weight()).all())}
    return {"step": None, "error": ("ok", ""), "unchanged": None, "table_finite": None}
