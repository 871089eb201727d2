"""Embedding ids: what counts as valid, and the error every rank raises for a bad one."""
from __future__ import annotations

from typing import Optional

import torch

from embrace_fairseq.core.errors import UserError


class InvalidIdError(UserError, ValueError):
    """An id outside ``[0, num_embeddings)`` reached a sharded table (on some rank)."""


def validate_ids(ids: torch.Tensor, num_embeddings: int) -> Optional[int]:
    """First offending id (the smallest invalid one), or None when all are valid.

    One host sync (one read-back of the range; kept: raising is a host decision)."""
    if ids.numel() == 0:
        return None
    lo, hi = torch.stack(torch.aminmax(ids.long())).tolist()
    if lo < 0:
        return lo
    if hi >= num_embeddings:
        return hi
    return None


def invalid_id_message(bad_id: int, num_embeddings: int, rank: int) -> str:
    return (
        f"embedding id {bad_id} is out of range for a table of {num_embeddings} rows "
        f"(valid ids are 0..{num_embeddings - 1}); seen on rank {rank}"
    )
