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
addressed to other ranks. A sparse tensor all-reduced (torch DDP's bucket of a sparse
gradient) is counted as what gloo does with it: an all-gather of its indices and values
(op ``sparse_all_reduce``); ``reduce`` (ZeRO's gradients to their owner) as the ring's
reduce-scatter part.

With a :class:`~embrace_fairseq.core.trace.Tracer` set (:attr:`CollectiveCounter.tracer`)
every collective also goes on that timeline, as EmbRace's hook puts its own: an
asynchronous one (``async_op=True``, torch DDP's buckets) from its issue to its
completion (the work's future), on the lane that can hide behind compute; a synchronous
one from call to return on the blocking lane (the calling thread computes nothing
meanwhile), so :meth:`~embrace_fairseq.core.trace.Tracer.summary`'s ``hidden_share`` of a
stock path means what it means for EmbRace.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.core.ring_volume import (
    ring_allgather_block_bytes,
    ring_allreduce_bytes,
    ring_reduce_scatter_bytes,
)
from embrace_fairseq.core.trace import COMM_TID, EXCHANGE_TID, Tracer


class CollectiveCounter:
    """Per-op bytes sent by this rank while :meth:`active` (thread-safe)."""

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.enabled = False
        #: the timeline the counted collectives also go on (None: counted only)
        self.tracer: Optional[Tracer] = None

    def add(self, op: str, nbytes: float) -> None:
        if self.enabled:
            with self._lock:
                self.bytes[op] += float(nbytes)
                self.calls[op] += 1

    def take(self) -> Dict[str, float]:
        """Bytes by op since the last take, and reset (the calls too: :meth:`take_calls`
        first to keep them)."""
        with self._lock:
            out = dict(self.bytes)
            self.bytes.clear()
            self.calls.clear()
        return out

    def take_calls(self) -> Dict[str, int]:
        """Calls by op since the last take (bytes kept for :meth:`take`)."""
        with self._lock:
            out = dict(self.calls)
            self.calls.clear()
        return out

    def trace(self, op: str, nbytes: float, start_us: float, work: Any) -> None:
        """Put one collective on :attr:`tracer`: ``work`` the asynchronous work it returned
        (its future's completion ends it) or None (it ended on return)."""
        tracer = self.tracer
        if tracer is None or not self.enabled:
            return
        if work is None or not hasattr(work, "get_future"):
            tracer.collective(op, int(nbytes), start_us, tracer.now(), tid=EXCHANGE_TID)
            return

        def done(_: Any) -> None:
            tracer.collective(op, int(nbytes), start_us, tracer.now(), tid=COMM_TID)

        try:
            work.get_future().add_done_callback(done)
        except Exception:  # a work without a future: its end is not known, its bytes are
            pass


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
            op, nbytes = name, 0.0
            try:
                sized = size_fn(*args, **kwargs)
                op, nbytes = sized if isinstance(sized, tuple) else (name, sized)
                counter.add(op, nbytes)
            except Exception:  # counting must never change behaviour
                pass
            tracer = counter.tracer
            start = tracer.now() if tracer is not None else 0.0
            out = orig(*args, **kwargs)
            counter.trace(op, nbytes, start, out if kwargs.get("async_op") else None)
            return out

        wrapper.__wrapped__ = orig
        setattr(dist, name, wrapper)

    def all_reduce(tensor, *a, group=None, **k):
        if tensor.is_sparse:  # gloo all-gathers a sparse tensor's indices and values
            t = tensor.coalesce() if not tensor.is_coalesced() else tensor
            return "sparse_all_reduce", ring_allgather_block_bytes(_nbytes(t._indices()) + _nbytes(t._values()),
                                                                   _world(group))
        return ring_allreduce_bytes(_nbytes(tensor), _world(group))

    def reduce(tensor, *a, group=None, **k):
        return ring_reduce_scatter_bytes(_nbytes(tensor), _world(group))

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
    wrap("reduce", reduce)
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
