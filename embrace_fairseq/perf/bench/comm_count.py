"""Bytes the stock paths send, counted at the ``torch.distributed`` calls they make.

fairseq's ``legacy_ddp``, DeepSpeed and EmbRace's exchanges all call the module-level
functions of ``torch.distributed`` (looked up at call time), so wrapping those counts
every collective they issue. Torch DDP (``c10d``) reduces from C++ unless a Python
communication hook is registered; the benchmark registers torch's stock ``allreduce_hook``
(the same collective), which calls ``torch.distributed.all_reduce``.

Bytes are what one rank sends under the usual algorithms (the convention of
:mod:`embrace_fairseq.core.ledger` and of the analytic bounds): the ring formulas of
:mod:`embrace_fairseq.core.ring_volume` (all-reduce 2(N-1)/N of the payload, all-gather
(N-1) times the local part, reduce-scatter (N-1)/N of the input), AlltoAll the parts
addressed to other ranks.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Dict, Iterator

import torch
import torch.distributed as dist

from embrace_fairseq.core.ring_volume import (
    ring_allgather_block_bytes,
    ring_allreduce_bytes,
    ring_reduce_scatter_bytes,
)


class CollectiveCounter:
    """Per-op bytes sent by this rank while :meth:`active` (thread-safe)."""

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.enabled = False

    def add(self, op: str, nbytes: float) -> None:
        if self.enabled:
            with self._lock:
                self.bytes[op] += float(nbytes)
                self.calls[op] += 1

    def take(self) -> Dict[str, float]:
        """Bytes by op since the last take, and reset."""
        with self._lock:
            out = dict(self.bytes)
            self.bytes.clear()
            self.calls.clear()
        return out


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def counting(counter: CollectiveCounter) -> Iterator[CollectiveCounter]:
    """Wrap the ``torch.distributed`` collectives so ``counter`` sees them; restore on exit."""
    originals = {}

    def wrap(name, size_fn):
        orig = getattr(dist, name, None)
        if orig is None:
            return
        originals[name] = orig

        def wrapper(*args, **kwargs):
            try:
                counter.add(name, size_fn(*args, **kwargs))
            except Exception:  # counting must never change behaviour
                pass
            return orig(*args, **kwargs)

        wrapper.__wrapped__ = orig
        setattr(dist, name, wrapper)

    def all_reduce(tensor, *a, group=None, **k):
        return ring_allreduce_bytes(_nbytes(tensor), _world(group))

    def all_gather(tensor_list, tensor, *a, group=None, **k):
        return ring_allgather_block_bytes(_nbytes(tensor), _world(group))

    # torch's parameter names: DeepSpeed passes these by keyword
    def all_gather_into_tensor(output_tensor, input_tensor, *a, group=None, **k):
        return ring_allgather_block_bytes(_nbytes(input_tensor), _world(group))

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
        n, r = _world(group), _rank(group)
        if input_split_sizes:
            row = _nbytes(input) / max(1, input.shape[0]) if input.dim() else 0
            return sum(s for i, s in enumerate(input_split_sizes) if i != r) * row
        return _nbytes(input) * (n - 1) / n

    def all_to_all(output_tensor_list, input_tensor_list, group=None, **k):
        in_list = input_tensor_list
        r = _rank(group)
        return sum(_nbytes(t) for i, t in enumerate(in_list) if i != r)

    def reduce_scatter_tensor(output, input, *a, group=None, **k):
        return ring_reduce_scatter_bytes(_nbytes(input), _world(group))

    def broadcast(tensor, src=0, group=None, **k):
        return _nbytes(tensor) if _rank(group) == src else 0

    wrap("all_reduce", all_reduce)
    wrap("all_gather", all_gather)
    wrap("all_gather_into_tensor", all_gather_into_tensor)
    wrap("all_to_all_single", all_to_all_single)
    wrap("all_to_all", all_to_all)
    wrap("reduce_scatter_tensor", reduce_scatter_tensor)
    wrap("broadcast", broadcast)
    # DeepSpeed's torch backend keeps the all-gather it found at start-up
    # (``all_gather_function``, ZeRO's parameter all-gather): point it at the wrapper too
    backend = _deepspeed_backend()
    kept = getattr(backend, "all_gather_function", None)
    if kept is not None and kept is originals.get("all_gather_into_tensor"):
        backend.all_gather_function = dist.all_gather_into_tensor
    try:
        yield counter
    finally:
        for name, orig in originals.items():
            setattr(dist, name, orig)
        if kept is not None:
            backend.all_gather_function = kept


def _deepspeed_backend():
    """DeepSpeed's communication backend object when DeepSpeed set one up, else None."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None
