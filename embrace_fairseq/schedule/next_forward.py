"""Cross-iteration overlap: the dense all-reduce finishes during the *next* forward.

At the optimizer step the scheduled all-reduce is not waited for
(:meth:`ScheduledAllReduce.defer`); the step updates what it has (the tables' shards,
whose averaged gradients arrived in backward) and each dense bucket is updated later,
when the next forward is about to need it: a forward pre-hook on every layer waits for
the buckets holding that layer's parameters, puts their average into ``.grad`` and runs
the optimizer's rule on those parameters only (``update``). Pieces the next forward
needs first are the input layers' ones, which the 2D schedule's model level sends first,
so the later layers' communication runs behind the earlier layers' compute.

The same result as the whole-model step, provided ``update`` applies the optimizer's
per-parameter rule with the step's hyper-parameters (the adapter's job: element-wise
optimizers such as Adam, AdamW and SGD qualify; a global decision over every gradient,
as norm clipping or an fp16 overflow check, does not, and the adapters fall back to
overlap with backward only).

Which module reads which parameter: each element of an ``nn.ModuleList`` (a model's
layers) is taken to read only the parameters in its own subtree in its forward, as
fairseq's, Megatron's and Hugging Face's layers do. Outside the layers, a parameter
owned only by layer norms and embeddings (learned positions, ``layernorm_embedding``, a
pre-norm model's final ``layer_norm``) is completed when its owner's forward starts:
these modules read their own weights and no one else's, and parents call them rather
than read their weights. Without that, a BART-shaped model's encoder waited at the
forward's start for the buckets of the decoder's positions and layer norms, which the
model level sends after the encoder's. Every other parameter (a head's own weights, a
projection whose weight a parent may read directly, as attention's fast path reads its
projections') is completed before the model's forward starts.
:meth:`NextForwardUpdates.flush` completes everything (every rank, before the next
backward); :meth:`NextForwardUpdates.complete` does it on one rank alone (a checkpoint
writer reading the weights).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set

import torch

from embrace_fairseq.core.trace import Tracer
from embrace_fairseq.schedule.executor import ScheduledAllReduce

#: applies the step's optimizer rule to these parameters (their ``.grad`` holds the average)
Update = Callable[[List[torch.nn.Parameter]], None]


#: modules whose forward reads their own parameters and whose weights no parent reads
#: directly (a parameter owned only by these is completed at its owner's forward)
OWN_FORWARD_MODULES = (torch.nn.LayerNorm, torch.nn.Embedding)


def layer_buckets(module: torch.nn.Module, reducer: ScheduledAllReduce) -> Dict[torch.nn.Module, List[int]]:
    """{module to hook: the buckets its forward needs}: every ``ModuleList`` element
    (its subtree's parameters), every layer norm or embedding outside them (its own
    parameters, at each of its owners: tied weights wait where they are first read), and
    the root (every other reduced parameter), each in bucket priority order. Modules
    without reduced parameters are left out."""
    bucket_of = {}
    for b in reducer.schedule.buckets:
        for t in b.tensors:
            bucket_of[id(reducer.params[t])] = b.index
    covered: Set[int] = set()
    hooks: Dict[torch.nn.Module, Set[int]] = {}
    for sub in module.modules():
        if not isinstance(sub, torch.nn.ModuleList):
            continue
        for layer in sub:
            ids = [id(p) for p in layer.parameters() if id(p) in bucket_of and id(p) not in covered]
            if ids:
                covered.update(ids)
                hooks.setdefault(layer, set()).update(bucket_of[i] for i in ids)
    owners: Dict[int, List[torch.nn.Module]] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            if id(p) in bucket_of and id(p) not in covered:
                owners.setdefault(id(p), []).append(sub)
    rest: Set[int] = set()
    for i, b in bucket_of.items():
        if i in covered:
            continue
        mods = owners.get(i, [])
        if mods and all(isinstance(m, OWN_FORWARD_MODULES) for m in mods):
            for m in mods:
                hooks.setdefault(m, set()).add(b)
        else:
            rest.add(b)
    if rest:
        hooks[module] = hooks.get(module, set()) | rest
    return {m: sorted(bs, key=_urgency(reducer)) for m, bs in hooks.items()}


def _urgency(reducer: ScheduledAllReduce) -> Callable[[int], tuple]:
    """Sort key of bucket indices: the model level's priority (input-near first)."""
    prio = {b.index: (b.priority, b.index) for b in reducer.schedule.buckets}
    return prio.__getitem__


class NextForwardUpdates:
    """Applies each dense bucket's optimizer update when the next forward needs it.

    Args:
        module: the model (its forward pre-hooks are registered now).
        reducer: the scheduled all-reduce of the model's dense gradients.
        tracer: marks each update (``next_forward_update``) on the timeline.

    Use: at the optimizer step call :meth:`begin` (instead of ``reducer.finish()``),
    with the update rule and its hyper-parameters fixed for this step; then step the
    rest of the model as usual (the dense parameters have no ``.grad`` meanwhile).
    """

    def __init__(self, module: torch.nn.Module, reducer: ScheduledAllReduce,
                 tracer: Optional[Tracer] = None) -> None:
        self.reducer = reducer
        self.tracer = tracer or Tracer(enabled=False)
        self._update: Optional[Update] = None
        self._pending: Set[int] = set()
        self.buckets_by_module = layer_buckets(module, reducer)
        self._handles = [m.register_forward_pre_hook(self._pre_hook(bs)) for m, bs in self.buckets_by_module.items()]
        #: buckets updated inside a forward (not by a flush) in the last completed step
        self.updated_in_forward = 0
        self._in_forward = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def pending(self) -> bool:
        return bool(self._pending) or self.reducer.deferred

    def begin(self, update: Update) -> None:
        """The step: leave the dense all-reduce running; ``update`` applies each bucket later."""
        self.complete()  # nothing is left here when flush() ran before the backward
        self.reducer.defer()
        self._update = update
        self._pending = {b.index for b in self.reducer.schedule.buckets}
        self.updated_in_forward = 0

    def _pre_hook(self, buckets: Sequence[int]):
        def hook(mod: torch.nn.Module, args: object) -> None:
            # the communication is drained by flush(), before the next backward: a point
            # every rank reaches in the same order (layers may be skipped, e.g. LayerDrop)
            if self._pending:
                for b in buckets:
                    if b in self._pending:
                        self._apply(b, in_forward=True)

        return hook

    def _apply(self, b: int, in_forward: bool) -> None:
        assert self._update is not None
        params = self.reducer.wait_bucket(b)
        self._update(params)
        for p in params:
            p.grad = None  # the next backward accumulates afresh
        self._pending.discard(b)
        self.updated_in_forward += int(in_forward)
        self.tracer.instant("next_forward_update", bucket=b, in_forward=in_forward)

    def complete(self) -> None:
        """Complete every pending update now (most urgent first) and wait for the
        communication. Local: any rank may call it on its own (a checkpoint writer)."""
        if self._pending:
            for b in sorted(self._pending, key=_urgency(self.reducer)):
                self._apply(b, in_forward=False)
        self.reducer.drain()

    def flush(self) -> None:
        """:meth:`complete`, then what the reducer does once after its first step (the
        rates of its static list). Collective: every rank at the same point, as before
        a backward."""
        self.complete()
        self.reducer.measure_rates()
