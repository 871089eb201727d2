"""The issue point every collective of the package passes (:func:`issuing`), right
before it is handed to torch.

It runs the registered issue fences (:func:`add_issue_fence`: the dense schedule's
single-thread mode settles its all-reduces there, so that every rank issues them at the
same place relative to the other collectives, see ``schedule/issue.py``) and, with
``EMBRACE_ISSUE_LOG=DIR``, writes one line per collective as issued to
``DIR/issue.rank<N>.log``: sequence number, op, group (its name and ranks,
:func:`~embrace_fairseq.core.backends.group_label`), element count (``var`` where the
ranks' counts differ by design: AlltoAlls with splits, pickled objects). Collectives on
host-side vote groups (:func:`mark_host_vote`) are not part of the device issue order
and are not logged.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from embrace_fairseq.core.backends import group_label, is_distributed, rank

Group = Optional["dist.ProcessGroup"]

_FENCES: List[Callable[[str, Group], None]] = []
_FENCE_STATE = threading.local()
_LOG_LOCK = threading.Lock()
_LOG: Dict[str, Any] = {"file": None, "seq": 0, "dir": None}
_HOST_VOTE_GROUPS: set = set()


def add_issue_fence(fence: Callable[[str, Group], None]) -> None:
    """Call ``fence(op, group)`` before every collective issued from now on (not from
    inside a fence): where the dense schedule's single-thread mode settles what it has
    issued so far (see ``schedule/issue.py``)."""
    _FENCES.append(fence)


def remove_issue_fence(fence: Callable[[str, Group], None]) -> None:
    if fence in _FENCES:
        _FENCES.remove(fence)


class fences_off:
    """Collectives issued in this ``with`` body, on this thread, pass no fence: the
    fence's owner's own (the dense pieces, the fence's vote)."""

    def __enter__(self) -> None:
        self._was = getattr(_FENCE_STATE, "inside", False)
        _FENCE_STATE.inside = True

    def __exit__(self, *exc: Any) -> None:
        _FENCE_STATE.inside = self._was


def _issue_log() -> Any:
    path = os.environ.get("EMBRACE_ISSUE_LOG")
    if not path:
        return None
    if _LOG["dir"] != path:
        os.makedirs(path, exist_ok=True)
        if _LOG["file"] is not None:
            _LOG["file"].close()
        _LOG["file"] = open(os.path.join(path, f"issue.rank{rank()}.log"), "w", buffering=1)
        _LOG["dir"], _LOG["seq"] = path, 0
    return _LOG["file"]


def issuing(op: str, group: Group, numel: Any) -> None:
    """A collective is about to be issued: run the fences, then log it (see module doc)."""
    if _FENCES and not getattr(_FENCE_STATE, "inside", False):
        _FENCE_STATE.inside = True
        try:
            for fence in list(_FENCES):
                fence(op, group)
        finally:
            _FENCE_STATE.inside = False
    if not os.environ.get("EMBRACE_ISSUE_LOG") or not is_distributed():
        return
    label = group_label(group)
    if label in _HOST_VOTE_GROUPS:
        return
    with _LOG_LOCK:
        f = _issue_log()
        _LOG["seq"] += 1
        f.write(f"{_LOG['seq']} {op} {label} {numel}\n")


def mark_host_vote(group: Group) -> None:
    """``group`` carries host-side votes only: outside the device issue order (and the log)."""
    _HOST_VOTE_GROUPS.add(group_label(group))
