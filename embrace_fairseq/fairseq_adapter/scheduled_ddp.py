"""fairseq-train with the 2D schedule: an EmbRace model's dense gradients all-reduced
during the backward, in the schedule's order, by the executor the DeepSpeed hook uses.

fairseq wraps the model for data parallelism in ``models.DistributedFairseqModel``
(``--ddp-backend``: torch DDP or ``legacy_ddp``). For a model with vocab-sharded tables
and ``--embrace-schedule on`` (the default) the wrapper is :class:`ScheduledDataParallel`
instead, whichever of those backends is named; ``--embrace-schedule off`` keeps
fairseq's own. What fairseq's trainer asks of the wrapper keeps its meaning:

* ``no_sync()`` (``--update-freq``): a backward inside it only accumulates;
* ``all_reduce_grads()`` (called by fairseq's optimizer before it scales, clips and
  steps): waits for every piece and leaves the gradients averaged over ranks in
  ``.grad``, as ``legacy_ddp`` does; clipping and overflow checks then see every
  gradient, as with the stock backends.

The algorithm is in :mod:`embrace_fairseq.schedule` (plan, executor);
this module only wires it to fairseq.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from fairseq import models as fairseq_models
from fairseq.distributed import ModuleProxyWrapper

from embrace_fairseq.core import collectives
from embrace_fairseq.core.sharded_embedding import job_topology, sharded_embeddings
from embrace_fairseq.core.trace import Tracer
from embrace_fairseq.schedule.exchange_marks import scope_grad_exchanges, trace_tables
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.model_inputs import dense_parameters, tensor_specs
from embrace_fairseq.schedule.plan import ScheduleOptions, build_schedule

logger = logging.getLogger(__name__)

SCHEDULE_FLAG = "--embrace-schedule"
SCHEDULE_MODES = ("on", "off")
TRACE_FLAG = "--embrace-trace"
TRACE_HELP = ("with the 2D schedule: write a Chrome trace per rank, DIR/trace.rank<N>.json (forward, backward, "
              "every dense piece and embedding exchange), and log the bytes by kind and the share of communication "
              "hidden behind compute at the end of training")
SCHEDULE_HELP = ("on: the dense gradients of an EmbRace model are all-reduced during the backward in the 2D "
                 "schedule's order (input-near layers first, in pieces), replacing --ddp-backend's reduction; "
                 "off: fairseq's own data-parallel wrapper. Under --embrace-plan auto, 'on' lets the plan "
                 "decide (and size the buckets and pieces), 'off' holds")

_APPLIED = False


class ScheduledDataParallel(nn.Module):
    """fairseq's data-parallel wrapper for EmbRace models under the 2D schedule.

    Args:
        module: the model (its sharded tables exchange their own rows).
        process_group: the data-parallel group fairseq gives its wrappers.
        options: the schedule's knobs (defaults: :class:`ScheduleOptions`).
        trace: a directory for the per-rank Chrome traces (None: no trace).
        two_level: on several nodes of several ranks, all-reduce in two levels
            (``--embrace-two-level-allreduce``; see the executor).
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 options: Optional[ScheduleOptions] = None, trace: Optional[str] = None,
                 two_level: bool = False) -> None:
        super().__init__()
        self.module = module
        self.accumulate_grads = False
        self.trace = trace
        self.tracer = Tracer(rank=collectives.rank(), enabled=trace is not None)
        options = options or ScheduleOptions()
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        # the all-reduces get a group of their own (created now, in the same order on every
        # rank): the tables' exchanges of the autograd thread use the default one
        group = collectives.new_group(ranks)
        self.schedule = build_schedule(tensor_specs(module), options)
        tables = [emb for emb in sharded_embeddings(module) if emb.is_sharded]
        # no exchange gate: fairseq's trainer waits for every gradient before its update (it
        # takes the gradient norm), so a dense piece held for the embedding exchange would
        # only idle the link (off by default on the DeepSpeed hook too)
        self.reducer = ScheduledAllReduce(dense_parameters(module), self.schedule, group, overlap=True,
                                          active=self._reducing, gate=None, tracer=self.tracer,
                                          trace_backward=True, topology=job_topology(tables),
                                          two_level=two_level, module=module)
        trace_tables(tables, self.tracer)
        scope_grad_exchanges(tables, None, self._reducing)
        self._closed = False
        if trace is not None:
            atexit.register(self.close)
        logger.info("EmbRace 2D schedule: %d dense tensors in %d buckets, %d pieces, all-reduced during the "
                    "backward (replaces the --ddp-backend reduction; --embrace-schedule off restores it)",
                    len(self.schedule.tensors), len(self.schedule.buckets), len(self.schedule.issue_order))

    def _reducing(self) -> bool:
        return not self.accumulate_grads

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (fairseq's ``--update-freq``)."""
        old = self.accumulate_grads
        self.accumulate_grads = True
        try:
            yield
        finally:
            self.accumulate_grads = old

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self.tracer.phase("forward"):
            return self.module(*inputs, **kwargs)

    def summary(self) -> dict:
        """Bytes by kind and the hidden share of communication (from the trace)."""
        return self.tracer.summary()

    def close(self) -> Optional[str]:
        """End of training (at exit when tracing): write ``<trace>/trace.rank<N>.json``
        and log the summary once (rank 0). Returns the trace's path."""
        if self._closed or self.trace is None:
            return None
        self._closed = True
        path = self.tracer.save(os.path.join(self.trace, "trace"))
        if collectives.rank() == 0:
            s = self.summary()
            mb = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(s["bytes_by_kind"].items()))
            logger.info("EmbRace summary (rank 0): %s; communication %.1f s, %.0f%% hidden behind compute; "
                        "%d of %d dense collectives began during their backward; trace %s",
                        mb or "nothing sent", s["comm_seconds"], 100 * s["hidden_share"],
                        s["dense_started_in_backward"], s["dense_collectives"], path)
        return path

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Wait for the scheduled all-reduce; the averaged gradients are then in ``.grad``."""
        if not self.accumulate_grads:
            self.reducer.finish()


def wants_schedule(model: nn.Module) -> bool:
    """An EmbRace model built with ``--embrace-schedule on`` (the default)."""
    return getattr(model, "embrace_schedule", "off") == "on" and any(e.is_sharded for e in sharded_embeddings(model))


def _distributed_model(original):
    @functools.wraps(original)
    def wrap(args: Any, model: nn.Module, process_group: Any, device: torch.device) -> nn.Module:
        if getattr(args, "tpu", False) or not wants_schedule(model):
            return original(args, model, process_group, device)
        trace = getattr(model, "embrace_trace", None)
        # the plan's bucket and piece sizes where --embrace-plan auto chose them
        options = getattr(model, "embrace_schedule_options", None)
        return ModuleProxyWrapper(ScheduledDataParallel(model.to(device), process_group, options=options, trace=trace,
                                                        two_level=getattr(model, "embrace_two_level", False)))

    return wrap


def apply() -> None:
    """Route fairseq's data-parallel wrapping of EmbRace models here (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    fairseq_models.DistributedFairseqModel = _distributed_model(fairseq_models.DistributedFairseqModel)
    _APPLIED = True
