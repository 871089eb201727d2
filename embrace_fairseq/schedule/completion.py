"""Completion tracking of the dense all-reduce: a piece's accounting once it finished, the
averaged gradients back into ``.grad``, and a deferred step's per-bucket waits.

Part of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce` (a mixin: the
executor holds the state and orchestrates).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core import ledger as K
from embrace_fairseq.core.ring_volume import ring_allreduce_bytes_int
from embrace_fairseq.core.trace import clock_name


class CompletionMixin:
    """Completion of :class:`~embrace_fairseq.schedule.executor.ScheduledAllReduce`."""

    def _complete(self, item: tuple) -> None:
        pending, piece = item
        pending.synchronize()  # finished, not only ordered: a CUDA event on GPUs
        pending.wait()
        nbytes, inter = self._dense_bytes(piece.numel, self._flat[piece.bucket])
        for ledger in self.ledgers:
            ledger.record(K.DENSE_GRAD, nbytes, nbytes, inter)
        self.tracer.collective(K.DENSE_GRAD, piece.nbytes, pending.issued_us, pending.end_us(),
                               clock=clock_name(pending.device), bucket=piece.bucket, piece=piece.index)

    def _dense_bytes(self, numel: int, flat: torch.Tensor) -> Tuple[int, Optional[int]]:
        """Bytes this rank sends for one piece, and how many of them leave its node (None:
        no topology, every rank counted as a node of its own)."""
        esize, t = flat.element_size(), self.topology
        if self.two_level is not None and flat.device.type == "cpu":
            # chunks exchanged inside the node twice, this rank's chunk all-reduced across nodes
            mine = collectives.chunk_sizes(numel, t.ranks_per_node)[t.local_of(collectives.rank())]
            across = ring_allreduce_bytes_int(mine * esize, t.num_nodes)
            return (numel - mine) * esize + (t.ranks_per_node - 1) * mine * esize + across, across
        # ring all-reduce (in rank order): each rank sends and receives 2 (N-1)/N of the
        # payload, to the next rank: across nodes from the last rank of each node
        nbytes = ring_allreduce_bytes_int(numel * esize, self.world_size)
        if t is None:
            return nbytes, None
        last_of_node = t.local_of(collectives.rank()) == t.ranks_per_node - 1 and t.num_nodes > 1
        return nbytes, nbytes if last_of_node else 0

    # ------------------------------------------------------------------ completion
    def _average(self) -> None:
        for bucket in self.schedule.buckets:
            self._average_bucket(bucket.index)

    def _average_bucket(self, b: int) -> None:
        bucket = self.schedule.buckets[b]
        flat = self._flat[b]  # already divided by the world size before its sum (IssueMixin._flatten)
        offset = 0
        for t in bucket.tensors:
            p = self.params[t]
            view = flat[offset : offset + p.numel()].view_as(p)
            if self._deferred:
                p.grad = view  # .grad was cleared at defer(); the buffer lives until the next backward
            else:
                p.grad.copy_(view)
            offset += p.numel()

    # ------------------------------------------------------------------ deferred completion

    @torch.no_grad()
    def wait_bucket(self, b: int) -> List[torch.nn.Parameter]:
        """Deferred step: wait for bucket ``b``'s pieces, leave its average in ``.grad``
        of its parameters and return them. Once per bucket; on NCCL the wait orders the
        current stream after the all-reduce (no host wait)."""
        if not self._deferred:
            raise RuntimeError("wait_bucket() outside a deferred step")
        params = [self.params[t] for t in self.schedule.buckets[b].tensors]
        if b in self._averaged:
            return params
        for piece in self.schedule.pieces_of(b):
            with self._issued_cond:
                while (piece.bucket, piece.index) not in self._issued:
                    if self._error is not None:
                        raise RuntimeError(f"dense gradient all-reduce failed: {self._error}") from self._error
                    self._issued_cond.wait(timeout=1.0)
                pending = self._issued[(piece.bucket, piece.index)]
            pending.wait()
        self._average_bucket(b)
        self._averaged.add(b)
        return params

    def drain(self) -> None:
        """Deferred step: wait for the rest of the communication (and its accounting)
        and reset for the next backward. Every bucket must have been waited for."""
        if not self._deferred:
            return
        missing = [b.index for b in self.schedule.buckets if b.index not in self._averaged]
        try:
            if self.single_thread:
                while self._inflight:
                    self._complete(self._inflight.pop(0))
            elif self._thread is not None:
                self._thread.join()
            error = self._error
            if error is not None:
                raise RuntimeError(f"dense gradient all-reduce failed: {error}") from error
            if missing:
                raise RuntimeError(f"drain() before wait_bucket() of buckets {missing}")
            self._log_no_grad()
        finally:
            self._reset()
