"""The benchmark builders: the ways to train the same model data-parallel, each as a ``step(batch)``.

(0) ``compute_floor``: the stock model and optimizer stepping the same batches with no
    collective at all (the physical floor every strategy is measured against);
(a) ``fairseq_legacy_ddp`` / ``fairseq_c10d``: the stock fairseq model under fairseq's
    ``DistributedFairseqModel`` (``LegacyDistributedDataParallel``; torch DDP for c10d);
(b) ``deepspeed``: the stock model under the stock DeepSpeed engine (ZeRO stage 0);
(b1) ``deepspeed_zero1`` / (b2) ``deepspeed_zero2``: the stock model under DeepSpeed ZeRO
    stage 1 / 2 as DeepSpeed users run it (:data:`ZERO_TUNING`: ``overlap_comm``,
    ``contiguous_gradients``, 25 MB buckets): gradients reduced in buckets (during the
    backward at stage 2), each rank steps its partition of the optimizer state, the
    updated partitions all-gathered;
(c) ``sparse_allgather``: the stock model with ``nn.Embedding(sparse=True)`` under
    DeepSpeed, which all-gathers the sparse gradient's indices and values; the torch Adam
    then gets the gathered gradient as a dense tensor (it takes no sparse gradients);
(d) ``embrace_noschedule``: the EmbRace architecture on DeepSpeed with the EmbRace hook,
    schedule off (``overlap``, ``model_level``, ``tensor_level`` false);
(d') ``embrace_fifo``: the same with plain overlap (``model_level``, ``tensor_level``
    false): whole buckets all-reduced during the backward in readiness order;
(e) ``embrace_schedule``: the same with the 2D schedule on (the hook's defaults);
(e'') ``embrace_relaxed``: (e) with the relaxed embedding dependency (the next batch's
    ids given before each backward; the other rows' gradients finish during the next
    forward);
    in both, a tied output table is read as ``--embrace-output auto`` (the default)
    decides per step: vocab-parallel when it moves fewer bytes than gathering the table;
(e') ``embrace_contiguous``: (e) with contiguous shards (rank 0 owns the most frequent
    words of the frequency-sorted dictionary) instead of the default strided ones.

Each is registered with its strategy in :mod:`embrace_fairseq.perf.strategies`.
Every strategy: same fairseq arguments, seed, criterion, torch Adam (lr 1e-3), no
clipping (DeepSpeed's default of 1.0 turned off), loss = criterion sum / sample size of the rank's batch.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from embrace_fairseq.perf.bench import workloads as W
from embrace_fairseq.perf.bench.comm_count import CollectiveCounter

from embrace_fairseq.perf.strategies import get_strategy

LR = 1e-3
ROWS_PER_RANK = 1  # DeepSpeed's micro batch size: one fairseq batch per rank


class _CallThrough:
    """Lets a fairseq criterion call a wrapper (DDP, engine) while reading the module's attributes."""

    def __init__(self, wrapped: Callable, module: torch.nn.Module) -> None:
        self._wrapped, self._module = wrapped, module
        # as fairseq's and DeepSpeed's wrappers hold it: the vocab-parallel masked-LM loss
        # finds the model it was configured for through ``.module``
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@dataclass
class Strategy:
    name: str
    module: torch.nn.Module  # the fairseq model itself
    step_fn: Callable[..., float]  # (batch, next batch or None) -> loss
    engine: Any = None
    steps_done: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def hook(self) -> Any:
        return getattr(self.engine, "embrace", None)

    @property
    def looks_ahead(self) -> bool:
        """Does a step need the next batch (the relaxed embedding dependency)?"""
        return self.hook is not None and self.hook.relaxed is not None

    def step(self, batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        loss = self.step_fn(batch, next_batch)
        self.steps_done += 1
        return loss

    def link_changed(self) -> None:
        """The bench reshaped the links: the 2D schedule's static list, simulated for the
        link its reducer measured at start-up, is simulated again for this one, as a job
        started on it would have it (collective; after :meth:`settle`, untimed)."""
        reducer = getattr(self.hook, "reducer", None)
        if reducer is not None:
            self.settle()
            reducer.remeasure_link()
            self.hook.tracer.clear()  # untimed: no timed step's trace holds it

    def settle(self) -> None:
        """Finish work a step left running into the next forward (cross-iteration
        overlap): the bench calls it, timed, before another strategy runs, so that
        no strategy's communication hides behind another's compute."""
        if self.hook is not None:
            self.hook.flush()


def _loss(criterion, model_like, batch) -> torch.Tensor:
    loss, sample_size, _ = criterion(model_like, batch)
    return loss / max(1, sample_size)


#: ZeRO settings of the stock ZeRO baselines, as DeepSpeed's tuning guide sets them: gradient
#: reduction overlapped with the backward, gradients copied into one contiguous buffer, and
#: buckets of 25 MB of fp32 (torch DDP's default; DeepSpeed's 5e8 elements would make one
#: bucket of these models and leave nothing to overlap).
ZERO_BUCKET_NUMEL = 25 * 2**20 // 4
ZERO_TUNING: Dict[str, Any] = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": ZERO_BUCKET_NUMEL,
    "allgather_bucket_size": ZERO_BUCKET_NUMEL,
}


#: fairseq's DistributedFairseqModel options of the (a)/(a') baselines: fairseq's defaults
FAIRSEQ_DDP = {"bucket_cap_mb": 25, "broadcast_buffers": False, "find_unused_parameters": False,
               "gradient_as_bucket_view": False}


def baseline_settings() -> Dict[str, str]:
    """Each strategy's settings as the report prints them (every strategy: torch Adam, lr
    :data:`LR`, no clipping, fp32)."""
    ddp = ", ".join(f"{k}={v}" for k, v in FAIRSEQ_DDP.items())
    zero = ", ".join(f"{k}={v}" for k, v in ZERO_TUNING.items())
    return {
        "fairseq_legacy_ddp": f"--ddp-backend legacy_ddp, flat buffers of 2**28 elements; {ddp}",
        "fairseq_c10d": f"--ddp-backend c10d (torch DDP, torch's allreduce_hook); {ddp}",
        "deepspeed": "zero_optimization.stage 0 (DeepSpeed's defaults: one all-reduce after the backward)",
        "deepspeed_zero1": f"zero_optimization.stage 1, {zero}",
        "deepspeed_zero2": f"zero_optimization.stage 2, {zero}",
        "sparse_allgather": "stage 0, token table nn.Embedding(sparse=True) (DeepSpeed's sparse_gradients path)",
        "embrace_schedule": "\"embrace\" defaults: 2D schedule (4 MB buckets, 1 MB pieces, input-near first, "
                            "no exchange gate), strided shards, --embrace-output auto",
        "embrace_zero1": f"EmbRace defaults; dense layers: zero_optimization.stage 1, {zero}",
        "compute_floor": "stock model, every collective skipped",
    }


def _ds_config(embrace: Optional[Dict[str, Any]], batch_rows: int,
               zero: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_rows,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; fairseq's default is no clipping
        "steps_per_print": 10**9,
        "zero_optimization": zero or {"stage": 0},
    }
    if embrace is not None:
        cfg["embrace"] = embrace
    return cfg


def _fairseq_ddp(name: str, backend: str, w: W.Workload, task: Any, data) -> Strategy:
    """The stock model under fairseq's DistributedFairseqModel (``legacy_ddp`` or ``c10d``)."""
    import torch.distributed as dist
    from fairseq.models.distributed_fairseq_model import DistributedFairseqModel

    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.stock_arch, task, data)
    args = argparse.Namespace(tpu=False, ddp_backend=backend, device_id=0, ddp_comm_hook="none", **FAIRSEQ_DDP)
    wrapped = DistributedFairseqModel(args, model, dist.group.WORLD, torch.device("cpu"))
    if backend == "c10d":
        # torch's stock all-reduce hook (what DDP does by default), issued from Python so that
        # the counted torch.distributed.all_reduce sees its buckets
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        wrapped.module.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    call = _CallThrough(wrapped, model)

    def step(batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        opt.zero_grad(set_to_none=True)
        loss = _loss(criterion, call, batch)
        loss.backward()
        if backend == "legacy_ddp":
            wrapped.all_reduce_grads()  # what fairseq's optimizer wrapper calls before the step
        opt.step()
        return float(loss.detach())

    return Strategy(name, model, step, extra={"optimizer": opt, "criterion": criterion})


def build_compute_floor(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                        trace_prefix: Optional[str] = None) -> Strategy:
    """The floor: each rank steps its own copy of the stock model on its batches, no
    collective at all (what any strategy's step would be with free communication)."""
    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.stock_arch, task, data)
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step(batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        opt.zero_grad(set_to_none=True)
        loss = _loss(criterion, model, batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return Strategy(name, model, step, extra={"optimizer": opt, "criterion": criterion})


def _on_deepspeed(name: str, model: torch.nn.Module, criterion: Any, engine: Any, opt: Any,
                  sparse: bool = False) -> Strategy:
    """One step through a DeepSpeed engine (stock or with the EmbRace hook)."""
    call = _CallThrough(engine, model)

    hook = getattr(engine, "embrace", None)

    def ds_step(batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        loss = _loss(criterion, call, batch)
        if hook is not None and hook.relaxed is not None:
            hook.next_batch(next_batch)  # the rows the next batch reads go first
        engine.backward(loss)  # stock: reduces here (the sparse gradient by all-gather)
        if sparse:
            for p in model.parameters():
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        engine.step()
        return float(loss.detach())

    return Strategy(name, model, ds_step, engine=engine, extra={"optimizer": opt, "criterion": criterion})


def _deepspeed_stock(name: str, w: W.Workload, task: Any, data, sparse: bool, zero_stage: int = 0) -> Strategy:
    """The stock model under the stock engine; ``sparse``: its token table sparse;
    ``zero_stage`` 1 or 2: ZeRO with :data:`ZERO_TUNING`."""
    import deepspeed

    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.stock_arch, task, data)
    if sparse:
        # the first table (a tied one's gradient is dense anyway: the output projection's adds to it)
        W.token_table_module(model, w).sparse = True
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    zero = {"stage": zero_stage, **ZERO_TUNING} if zero_stage else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(None, ROWS_PER_RANK, zero))
    return _on_deepspeed(name, model, criterion, engine, opt, sparse)


NO_OVERLAP = {"overlap": False, "model_level": False, "tensor_level": False}
FIFO_OVERLAP = {"model_level": False, "tensor_level": False}


def _embrace(name: str, w: W.Workload, task: Any, data, schedule: Any, trace_prefix: Optional[str],
             shard_layout: Optional[str] = None, zero_stage: int = 0, output: Optional[str] = None) -> Strategy:
    """The EmbRace architecture on DeepSpeed with the EmbRace hook, the 2D schedule on
    (``schedule`` True), off (False) or set by these ``"embrace"`` keys (a dict);
    ``shard_layout``: the ``"embrace"`` section's layout (None: the default);
    ``zero_stage`` 1: the dense layers under ZeRO-1 with :data:`ZERO_TUNING`;
    ``output``: ``--embrace-output`` for a tied output layer (None: the default, ``auto``)."""
    from embrace_fairseq.deepspeed_adapter import initialize
    from embrace_fairseq.fairseq_adapter.vocab_parallel_criteria import configure

    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.embrace_arch, task, data,
                          extra_args=("--embrace-output", output) if output is not None else ())
    configure(model, criterion)  # what fairseq's Trainer does: a tied output read vocab-parallel when cheaper
    section: Dict[str, Any] = dict(schedule) if isinstance(schedule, dict) else ({} if schedule else dict(NO_OVERLAP))
    if trace_prefix:
        section["trace"] = trace_prefix
    if shard_layout is not None:
        section["shard_layout"] = shard_layout
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    zero = {"stage": zero_stage, **ZERO_TUNING} if zero_stage else None
    engine, *_ = initialize(model=model, optimizer=opt, config=_ds_config(section, ROWS_PER_RANK, zero))
    return _on_deepspeed(name, model, criterion, engine, opt)


# The builders registered in embrace_fairseq.perf.strategies: each builds one strategy
# over the default process group (a collective: all ranks call it).
# Signature: (name, workload, task, data, counter, trace_prefix=None) -> Strategy.

def build_legacy_ddp(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                     trace_prefix: Optional[str] = None) -> Strategy:
    return _fairseq_ddp(name, "legacy_ddp", w, task, data)


def build_c10d(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
               trace_prefix: Optional[str] = None) -> Strategy:
    return _fairseq_ddp(name, "c10d", w, task, data)


def build_deepspeed(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                    trace_prefix: Optional[str] = None) -> Strategy:
    return _deepspeed_stock(name, w, task, data, sparse=False)


def build_deepspeed_zero1(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                          trace_prefix: Optional[str] = None) -> Strategy:
    return _deepspeed_stock(name, w, task, data, sparse=False, zero_stage=1)


def build_deepspeed_zero2(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                          trace_prefix: Optional[str] = None) -> Strategy:
    return _deepspeed_stock(name, w, task, data, sparse=False, zero_stage=2)


def build_sparse_allgather(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                           trace_prefix: Optional[str] = None) -> Strategy:
    return _deepspeed_stock(name, w, task, data, sparse=True)


def build_embrace_noschedule(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                             trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, False, trace_prefix)


def build_embrace_fifo(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                       trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, FIFO_OVERLAP, trace_prefix)


def build_embrace_relaxed(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                          trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"relaxed_embedding": True}, trace_prefix)


def build_embrace_schedule(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                           trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, True, trace_prefix)


def build_embrace_next_forward(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                               trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"next_forward": True}, trace_prefix)


def build_embrace_next_forward_gate(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                    trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"next_forward": True, "exchange_gate": True}, trace_prefix)


def build_embrace_next_forward_whole(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                     trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"next_forward": True, "tensor_level": False}, trace_prefix)


def build_embrace_zero1(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                        trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, True, trace_prefix, zero_stage=1)


def build_embrace_nogate(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                         trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"exchange_gate": False}, trace_prefix)


def build_embrace_gate(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                       trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"exchange_gate": True}, trace_prefix)


def build_embrace_contiguous(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                             trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, True, trace_prefix, shard_layout="contiguous")


def build_embrace_output_gather(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                trace_prefix: Optional[str] = None) -> Strategy:
    # where no output layer reads the table the rule has nothing to rule: (e) as it is
    return _embrace(name, w, task, data, True, trace_prefix, output="gather" if w.ties_output else None)


def build_embrace_output_vocab_parallel(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                        trace_prefix: Optional[str] = None) -> Strategy:
    # where no output layer reads the table the rule has nothing to rule: (e) as it is
    return _embrace(name, w, task, data, True, trace_prefix, output="vocab-parallel" if w.ties_output else None)


def build_embrace_eager_output_grad(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                    trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"defer_output_grad": False}, trace_prefix)


def build_embrace_node(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                       trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"exchange": "node"}, trace_prefix)


def build_embrace_two_level(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                            trace_prefix: Optional[str] = None) -> Strategy:
    return _embrace(name, w, task, data, {"two_level_allreduce": True}, trace_prefix)


def build(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
          trace_prefix: Optional[str] = None) -> Strategy:
    """Build the registered strategy ``name`` (a collective: all ranks call it)."""
    spec = get_strategy(name)
    return spec.build(spec.name, w, task, data, counter, trace_prefix=trace_prefix)
