"""Checkpoints of ``embrace-ds-train``: fairseq's layout, written atomically, resumable.

What a checkpoint holds (fairseq's keys, so ``fairseq-generate``/``fairseq-eval-lm
--user-dir user_dir`` read it):

* ``model``: dense weights and *full* embedding tables (gathered from every rank);
* ``last_optimizer_state``: ``shards`` (the shard optimizer's state as full tables, when
  shards are stepped outside DeepSpeed), ``dense`` (DeepSpeed's optimizer state when it
  is a plain torch optimizer: the same on every rank, sharded tables' moments gathered
  to full tables) or ``dense_per_rank`` (anything else, e.g. ZeRO's partitioned state:
  one serialized blob per rank; resuming it needs the same world size);
* ``optimizer_history[-1]``: ``num_updates`` and the LR scheduler state;
* ``extra_state``: fairseq's ``train_iterator`` (epoch and batches consumed), ``val_loss``,
  ``best``, and ``embrace_ds``: DeepSpeed's step counters and each rank's RNG state.

Resume-only state that is not plain tensors travels as ``torch.save`` bytes, so the
file stays loadable with ``weights_only=True``. Everything is read with
``weights_only=True`` (:mod:`embrace_fairseq.guards.safe_load`): the file and those bytes
may hold tensors, containers, numpy RNG states and DeepSpeed's loss scalers and slice
mappings, allowed for the load only; a file naming anything else is refused unrun.

Memory: gathering the full tables and moments is collective, but only rank 0 writes.
The other ranks drop them as soon as the gather is done, and rank 0 right after the
write: no rank keeps a full table (or its moments) between saves. Per-rank state
(ZeRO's optimizer partitions, RNG states) goes to rank 0 only, one sender at a time: a
rank that does not write never holds another rank's state, whatever the world size. Writing is fairseq's
(``checkpoint_utils.save_checkpoint`` from the trainer in :mod:`.trainer`), made atomic by
the user dir (:mod:`embrace_fairseq.fairseq_adapter.checkpoint_io`: temporary file, fsync,
rename, SHA-256 sidecar), so a crash leaves the previous checkpoint intact and a corrupted
file is refused on load. Loading is collective (every rank reads the file and keeps its
own rows).
"""
from __future__ import annotations

import io
import logging
import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import consolidate, release_consolidated
from embrace_fairseq.guards import safe_load
from embrace_fairseq.guards.atomic_io import load_checkpoint as atomic_load
from embrace_fairseq.optim.optimizer_state import gather_sharded_state, to_local_state, with_full_state

logger = logging.getLogger(__name__)


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def checkpoint_globals() -> List[Any]:
    """The classes a launcher checkpoint (and its ``torch.save`` bytes) may hold besides
    tensors and containers: numpy RNG states, DeepSpeed's loss scalers, ZeRO's stage and
    parameter slice mappings, fairseq's ``argparse.Namespace`` arguments (found by listing
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` of real ZeRO-0/1 checkpoints; ZeRO-2's hold the same)."""
    import argparse

    out: List[Any] = [argparse.Namespace] + safe_load.numpy_globals()
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum]
    except ImportError:  # pragma: no cover - the launcher needs DeepSpeed anyway
        pass
    return out


def _unblob(data: bytes, what: str = "resume state") -> Any:
    return safe_load.load(data, checkpoint_globals(), name=f"the {what} inside the checkpoint")


def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_objects(obj: Any) -> Optional[List[Any]]:
    """Every rank's ``obj`` on the writer (rank 0), None elsewhere: a rank that does not
    write receives no peer's state (under ZeRO each rank's optimizer partition)."""
    return collectives.gather_object(obj, dst=0)


def _plain_torch_optimizer(opt: Any) -> bool:
    return type(opt).__module__.startswith("torch.optim")


def gather_full_state(engine: Any, model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The model with full tables, the optimizer states with full-table moments and every
    rank's RNG: on rank 0 (the writer); None elsewhere. Collective. No rank keeps the
    full tables afterwards (the caller holds rank 0's until it has written them)."""
    hook, opt, writer = engine.embrace, engine.optimizer, collectives.rank() == 0
    consolidate(model)  # collective: every rank gathers, only the writer keeps
    try:
        state = model.state_dict() if writer else None
    finally:
        release_consolidated(model)
    shard_state = hook.shard_optimizer.full_state_dict() if hook.shard_optimizer is not None else None
    dense = dense_per_rank = None
    if _plain_torch_optimizer(opt):
        dense = with_full_state(opt.state_dict(), gather_sharded_state(opt))
    else:
        dense_per_rank = _gather_objects(_blob(opt.state_dict()))
    rng = _gather_objects(_blob(_rng_state()))
    if not writer:
        return None
    return {"model": {k: v.detach().cpu() for k, v in state.items()}, "rng": rng,
            "optimizer": {"shards": shard_state, "dense": dense, "dense_per_rank": dense_per_rank}}


def build_checkpoint(cfg: Any, engine: Any, criterion: Any, full: Dict[str, Any], *,
                     num_updates: int, lr_scheduler_state: Dict[str, Any], task_state: Optional[Dict[str, Any]] = None,
                     save_optimizer_state: bool = True) -> Dict[str, Any]:
    """The checkpoint dict (fairseq's keys) from :func:`gather_full_state`'s result on the
    writer. fairseq's ``save_checkpoint`` adds ``train_iterator``, ``val_loss`` and ``best``
    to ``extra_state``; the trainer adds fairseq's meters and training time."""
    from omegaconf import OmegaConf

    ckpt = {
        # a plain container, as fairseq's trainer saves it (loadable with weights_only)
        "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else cfg,
        "args": None,
        "model": full["model"],
        "criterion": None,
        "optimizer_history": [{
            "criterion_name": criterion.__class__.__name__,
            "optimizer_name": "DeepSpeedEngine",
            "lr_scheduler_state": lr_scheduler_state,
            "num_updates": int(num_updates),
        }],
        "task_state": task_state or {},
        "extra_state": {
            "metrics": {},
            "embrace_ds": {
                "world_size": collectives.world_size(),
                "global_steps": int(engine.global_steps),
                "global_samples": int(engine.global_samples),
                "skipped_steps": int(engine.skipped_steps),
                "rng_per_rank": full["rng"],
            },
        },
    }
    if save_optimizer_state:
        ckpt["last_optimizer_state"] = full["optimizer"]
    return ckpt


def scheduler_state(engine: Any) -> Dict[str, Any]:
    """DeepSpeed's LR scheduler state as the checkpoint keeps it (``{}`` without one)."""
    sched = engine.lr_scheduler
    return {"embrace_ds": _blob(sched.state_dict())} if sched is not None else {}


def load_scheduler_state(engine: Any, state: Dict[str, Any]) -> bool:
    """Restore DeepSpeed's LR scheduler from :func:`scheduler_state`'s dict; False when
    there is nothing to restore."""
    if engine.lr_scheduler is None or "embrace_ds" not in (state or {}):
        return False
    engine.lr_scheduler.load_state_dict(_unblob(state["embrace_ds"], "LR scheduler state"))
    return True


def read_checkpoint(path: str) -> Dict[str, Any]:
    """Every rank reads the file (``weights_only=True``); refuses truncated or corrupted
    files and files naming code outside the allow-list."""
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals

    # fairseq's meters and cfg travel in the file too (the trainer saves them)
    return atomic_load(path, map_location="cpu", allowed_globals=checkpoint_globals() + fairseq_checkpoint_globals())


def _load_optimizer(path: str, ckpt: Dict[str, Any], engine: Any) -> None:
    """DeepSpeed's optimizer and the shard optimizer from ``ckpt``."""
    rank, world = collectives.rank(), collectives.world_size()
    hook = engine.embrace
    opt_state = ckpt.get("last_optimizer_state") or {}
    if opt_state.get("dense") is not None:
        engine.optimizer.load_state_dict(to_local_state(opt_state["dense"], engine.optimizer))
        hook.optimizer_state_loaded()
    elif opt_state.get("dense_per_rank") is not None:
        blobs = opt_state["dense_per_rank"]
        if len(blobs) != world:
            raise ValueError(f"{path}: DeepSpeed's optimizer state was saved by {len(blobs)} ranks (ZeRO partitions it); "
                             f"resume with {len(blobs)} ranks or pass --reset-optimizer")
        what = "optimizer state"
        if engine.zero_optimization_stage() >= 1:
            engine.optimizer.load_state_dict([_unblob(b, what) for b in blobs])  # ZeRO takes every rank's
        else:
            engine.optimizer.load_state_dict(_unblob(blobs[rank], what))
        hook.optimizer_state_loaded()  # its fp32 masters came with it
    if hook.shard_optimizer is not None and opt_state.get("shards") is not None:
        hook.shard_optimizer.load_full_state_dict(opt_state["shards"])


def restore(path: str, ckpt: Dict[str, Any], engine: Any, model: torch.nn.Module, reset_optimizer: bool = False) -> None:
    """Weights (each rank keeps its rows), optimizer state, DeepSpeed's counters and each
    rank's RNG from a checkpoint read by :func:`read_checkpoint`. Collective. Without
    optimizer state (``reset_optimizer``) the fp32 master copies are refreshed from the
    loaded weights at the first step."""
    model.load_state_dict(ckpt["model"], strict=True)  # marks the masters stale (engine hook)
    extra = ckpt.get("extra_state") or {}
    ds = extra.get("embrace_ds") or {}
    rank, world = collectives.rank(), collectives.world_size()
    if not reset_optimizer:
        _load_optimizer(path, ckpt, engine)
        engine.global_steps = int(ds.get("global_steps", ckpt["optimizer_history"][-1]["num_updates"]))
        engine.global_samples = int(ds.get("global_samples", 0))
        engine.skipped_steps = int(ds.get("skipped_steps", 0))
    rng = ds.get("rng_per_rank")
    if rng is not None and len(rng) == world:
        _set_rng_state(_unblob(rng[rank], "RNG state"))
    collectives.barrier()


def load_checkpoint(path: str, engine: Any, model: torch.nn.Module, reset_optimizer: bool = False) -> Dict[str, Any]:
    """:func:`read_checkpoint` then :func:`restore`; returns the checkpoint's ``extra_state``."""
    ckpt = read_checkpoint(path)
    restore(path, ckpt, engine, model, reset_optimizer)
    return ckpt.get("extra_state") or {}
