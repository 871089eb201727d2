"""World-size independent optimizer state for sharded parameters.

A torch optimizer keeps per-parameter state shaped like the parameter (Adam's
moments, SGD's momentum). For a shard that is this rank's rows only. To save a
checkpoint that any world size can resume from, the state of every sharded
parameter is gathered to the full table (a collective, done on every rank before the
rank-0 save), and on load each rank keeps its own rows again.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple  # noqa: F401

import torch

from embrace_fairseq.core.sharded_embedding import table_of


def _indexed_params(optimizer: torch.optim.Optimizer) -> List[Tuple[int, torch.nn.Parameter]]:
    # torch numbers parameters across param_groups in order in state_dict()["state"].
    out, i = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append((i, p))
            i += 1
    return out


def gather_sharded_state(optimizer: torch.optim.Optimizer) -> Dict[int, Dict[str, torch.Tensor]]:
    """Full-table copies of the shard-shaped state of every sharded parameter.

    Collective over the tables' groups: call on every rank. Returns
    ``{param_index: {state_key: full_tensor}}`` in ``state_dict()`` numbering.
    """
    full: Dict[int, Dict[str, torch.Tensor]] = {}
    for idx, p in _indexed_params(optimizer):
        emb = table_of(p)
        if emb is None or not emb.is_sharded:
            continue
        state = optimizer.state.get(p, {})
        # Every rank must gather the same keys in the same order; states of a given
        # optimizer have the same keys on all ranks once a step has been taken.
        entry = {}
        for key in sorted(state):
            value = state[key]
            if torch.is_tensor(value) and value.dim() >= 1 and tuple(value.shape) == tuple(p.shape):
                entry[key] = emb.gather_shard_state(value)
        full[idx] = entry
    return full


def with_full_state(state_dict: Dict[str, Any], full: Dict[int, Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    """A copy of ``optimizer.state_dict()`` whose sharded entries hold full tables."""
    if not full:
        return state_dict
    out = dict(state_dict)
    out["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
    for idx, entry in full.items():
        if idx in out["state"]:
            out["state"][idx].update(entry)
    out["embrace_full_tables"] = sorted(full)
    return out


def to_local_state(state_dict: Dict[str, Any], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Slice full-table entries of a loaded optimizer state to this rank's rows."""
    params = dict(_indexed_params(optimizer))
    state = state_dict.get("state", {})
    out: Optional[Dict[str, Any]] = None
    for idx, entry in state.items():
        p = params.get(int(idx))
        emb = table_of(p) if p is not None else None
        if emb is None:
            continue
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == emb.num_embeddings and value.shape != p.shape:
                if out is None:
                    out = dict(state_dict)
                    out["state"] = {k: dict(v) for k, v in state.items()}
                out["state"][idx][key] = emb.shard_of(value).clone()
            elif torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] not in (emb.num_embeddings, p.shape[0]):
                raise ValueError(
                    f"optimizer state '{key}' of a sharded table has {value.shape[0]} rows; expected the full "
                    f"{emb.num_embeddings} rows or this rank's {p.shape[0]}"
                )
    if out is None:
        return state_dict
    out.pop("embrace_full_tables", None)
    return out
