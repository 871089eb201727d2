"""The benchmark builders: the ways to train the same model data-parallel, each as a ``step(batch)``.

(0) ``compute_floor``: the stock model and optimizer stepping the same batches with no
    collective at all (the physical floor every strategy is measured against);
(a) ``fairseq_legacy_ddp`` / ``fairseq_c10d``: the stock fairseq model under fairseq's
    ``DistributedFairseqModel`` (``LegacyDistributedDataParallel``; torch DDP for c10d);
(b) ``deepspeed``: the stock model under the stock DeepSpeed engine (ZeRO stage 0);
(b1) ``deepspeed_zero1`` / (b2) ``deepspeed_zero2``: the stock model under DeepSpeed ZeRO
    stage 1 / 2 as DeepSpeed's ZeRO tutorial tunes it (:func:`zero_tuning`:
    ``overlap_comm``, ``contiguous_gradients``, reduced to the owner, buckets scaled with
    the model): gradients reduced in buckets (during the backward at stage 2), each rank
    steps its partition of the optimizer state, the updated partitions all-gathered;
(c) ``sparse_allgather``: the stock model with ``nn.Embedding(sparse=True)`` under
    DeepSpeed, which all-gathers the sparse gradient's indices and values after the
    backward; the torch Adam then gets the gathered gradient as a dense tensor (it takes
    no sparse gradients);
(c') ``sparse_allgather_overlap``: the same table under torch DDP as (a'): the sparse
    gradient in a bucket of its own, all-gathered by gloo during the backward like the
    dense buckets;

Every bucket size is its experts' setting scaled with the model (:func:`bucket_settings`)
and recorded in the strategy's ``settings``; the stock paths keep a timeline of their
phases (``own_tracer``) that the bench's collective counter fills with their collectives.
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
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch

from embrace_fairseq.core.trace import Tracer
from embrace_fairseq.perf.bench import large_vocab as LV
from embrace_fairseq.perf.bench import shapes as SH
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
    #: a stock path's timeline (its phases; the bench's collective counter adds its
    #: collectives while the strategy is timed): the same trace EmbRace's hook keeps
    own_tracer: Any = None
    #: the settings it was built with (buckets, ZeRO's options), as the run records them
    settings: Dict[str, Any] = field(default_factory=dict)

    @property
    def hook(self) -> Any:
        return getattr(self.engine, "embrace", None)

    @property
    def tracer(self) -> Any:
        """The strategy's timeline: EmbRace's hook's, else its own (None: the floor)."""
        hook = self.hook
        return hook.tracer if hook is not None else self.own_tracer

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


class _Backward:
    """A stock path's backward on its timeline: from its start until the last gradient was
    computed, not until ``backward`` returns. Torch DDP waits for its buckets' all-reduces
    inside ``backward`` (the reducer's finalize callback), so the call's end would count that
    wait as compute and every bucket as hidden; EmbRace's backward ends when autograd does
    (its reducer waits at the step). The time of the last gradient is taken by a
    post-accumulate hook on every parameter."""

    def __init__(self, tracer: Tracer, module: torch.nn.Module) -> None:
        self.tracer = tracer
        self.last_us: Optional[float] = None
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, _: torch.Tensor) -> None:
        self.last_us = self.tracer.now()

    @contextlib.contextmanager
    def phase(self) -> Any:
        self.last_us = None
        start = self.tracer.now()
        try:
            yield
        finally:
            end = self.tracer.now()
            self.tracer.compute("backward", start, min(end, self.last_us or end))


def _loss(criterion, model_like, batch) -> torch.Tensor:
    loss, sample_size, _ = criterion(model_like, batch)
    return loss / max(1, sample_size)


def bucket_settings(w: W.Workload) -> Dict[str, Any]:
    """Every strategy's buckets for workload ``w``: its experts' settings scaled by the
    bench's gradient bytes over the real model's (:func:`.shapes.scaled_buckets`), so the
    bench model is split into as many buckets as the real one; a synthetic workload keeps
    the experts' settings as they are."""
    real = SH.real_numel(w.name)
    bench = LV.parameters(W.workload_dims(w))[1] if real is not None else None
    return SH.scaled_buckets(bench, real)


def zero_tuning(w: W.Workload) -> Dict[str, Any]:
    """ZeRO's settings as DeepSpeed's ZeRO tutorial tunes stage 1 and 2: reduction overlapped
    with the backward, gradients copied into one contiguous buffer, reduce-scatter instead of
    all-reduce, and each bucket's gradients reduced to the rank that owns them instead of
    all-reduced to every rank (``use_multi_rank_bucket_allreduce`` false: its docs keep the
    all-reduce for small models on very many GPUs); the buckets (5e8 elements) scaled with
    the model (:func:`bucket_settings`)."""
    b = bucket_settings(w)
    return {"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
            "use_multi_rank_bucket_allreduce": False,
            "reduce_bucket_size": b["zero_reduce_bucket_size"], "allgather_bucket_size": b["zero_allgather_bucket_size"]}


def fairseq_ddp(w: W.Workload) -> Dict[str, Any]:
    """fairseq's DistributedFairseqModel options (fairseq's defaults) with DDP's buckets
    scaled with the model: ``--bucket-cap-mb`` 25 and the first bucket 1 MiB (torch's
    ``_DEFAULT_FIRST_BUCKET_BYTES``, which DDP gave the first bucket under every cap in the
    torch releases fairseq 0.12 ran on), each times :func:`bucket_settings`' scale."""
    b = bucket_settings(w)
    return {"bucket_cap_mb": b["ddp_bucket_cap_mb"], "first_bucket_cap_mb": b["ddp_first_bucket_mb"],
            "broadcast_buffers": False, "find_unused_parameters": False, "gradient_as_bucket_view": False}


def embrace_buckets(w: W.Workload) -> Dict[str, int]:
    """The ``"embrace"`` section's buckets and pieces (4 MB and 1 MB by default) scaled with
    the model (:func:`bucket_settings`)."""
    b = bucket_settings(w)
    return {"bucket_bytes": max(1, int(b["embrace_bucket_mb"] * 2**20)),
            "piece_bytes": max(1, int(b["embrace_piece_mb"] * 2**20))}


def _settings(w: W.Workload, **own: Any) -> Dict[str, Any]:
    """What a strategy records: its own settings and the scaling they came from."""
    b = bucket_settings(w)
    return dict(own, bucket_scale=b["scale"], real_numel=b["real_numel"], bench_numel=b["bench_numel"],
                real_buckets=b.get("real_buckets"), expected_bench_buckets=b.get("bench_buckets"))


def baseline_settings() -> Dict[str, str]:
    """Each strategy's settings as the report prints them (every strategy: torch Adam, lr
    :data:`LR`, no clipping, fp32); the buckets' sizes per workload are each run's own
    (its strategies' ``settings``)."""
    zero = ("overlap_comm, contiguous_gradients, reduce_scatter, use_multi_rank_bucket_allreduce=false, "
            "reduce/allgather buckets of 5e8 elements scaled with the model")
    ddp = "bucket_cap_mb 25 and a 1 MiB first bucket scaled with the model, broadcast_buffers=False"
    return {
        "fairseq_legacy_ddp": "--ddp-backend legacy_ddp, flat buffers of 2**28 elements",
        "fairseq_c10d": f"--ddp-backend c10d (torch DDP, torch's allreduce_hook); {ddp}",
        "deepspeed": "zero_optimization.stage 0 (DeepSpeed's defaults: one all-reduce after the backward)",
        "deepspeed_zero1": f"zero_optimization.stage 1, {zero}",
        "deepspeed_zero2": f"zero_optimization.stage 2, {zero}",
        "sparse_allgather": "stage 0, token table nn.Embedding(sparse=True) (DeepSpeed's sparse_gradients path)",
        "sparse_allgather_overlap": f"torch DDP as (a'), an untied token table nn.Embedding(sparse=True) in a "
                                    f"bucket of its own (gloo all-gathers its indices and values); {ddp}",
        "embrace_schedule": "\"embrace\" defaults: 2D schedule (4 MB buckets, 1 MB pieces scaled with the model, "
                            "input-near first, no exchange gate), strided shards, --embrace-output auto",
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


def _fairseq_ddp(name: str, backend: str, w: W.Workload, task: Any, data, sparse: bool = False,
                 model: Optional[torch.nn.Module] = None) -> Strategy:
    """The stock model under fairseq's DistributedFairseqModel (``legacy_ddp`` or ``c10d``);
    ``sparse``: its token table ``nn.Embedding(sparse=True)`` where no output layer reads it
    (torch DDP all-reduces a sparse gradient in a bucket of its own, which gloo does by
    all-gathering its indices and values, during the backward like any bucket); ``model``:
    one built already (default: the stock architecture)."""
    import torch.distributed as dist
    from fairseq.models import distributed_fairseq_model as dfm

    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.stock_arch, task, data) if model is None else model
    table_sparse = sparse and not W.tied_tables(w)[0]
    if table_sparse:
        W.token_table_module(model, w).sparse = True
    options = fairseq_ddp(w)
    first_mb = options.pop("first_bucket_cap_mb")
    args = argparse.Namespace(tpu=False, ddp_backend=backend, device_id=0, ddp_comm_hook="none", **options)
    ddp_class = dfm.DistributedDataParallel
    if backend == "c10d":
        # fairseq passes one cap; torch takes a first bucket's own cap only as a list of caps
        # (the first, then the rest's): the same DDP with both of the experts' settings
        dfm.DistributedDataParallel = functools.partial(ddp_class, bucket_cap_mb_list=[first_mb, options["bucket_cap_mb"]])
    try:
        wrapped = dfm.DistributedFairseqModel(args, model, dist.group.WORLD, torch.device("cpu"))
    finally:
        dfm.DistributedDataParallel = ddp_class
    if backend == "c10d":
        # torch's stock all-reduce hook (what DDP does by default), issued from Python so that
        # the counted torch.distributed.all_reduce sees its buckets
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        wrapped.module.register_comm_hook(dist.group.WORLD, allreduce_hook)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    call = _CallThrough(wrapped, model)
    tracer = Tracer(rank=dist.get_rank())
    backward = _Backward(tracer, model)

    def step(batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        opt.zero_grad(set_to_none=True)
        with tracer.phase("forward"):
            loss = _loss(criterion, call, batch)
        with backward.phase():
            loss.backward()
        if backend == "legacy_ddp":
            wrapped.all_reduce_grads()  # what fairseq's optimizer wrapper calls before the step
        with tracer.phase("step"):
            _densify(model)
            opt.step()
        return float(loss.detach())

    settings = ({"ddp_backend": "legacy_ddp", "buffer_numel": 2**28} if backend == "legacy_ddp"
                else _settings(w, **{**options, "first_bucket_cap_mb": first_mb}))
    if sparse:
        settings["sparse_table"] = table_sparse
        if not table_sparse:
            settings["sparse_table_note"] = "tied table: its gradient is dense (the output layer's), as in c10d"
    return Strategy(name, model, step, extra={"optimizer": opt, "criterion": criterion}, own_tracer=tracer,
                    settings=settings)


def _densify(model: torch.nn.Module) -> None:
    """A sparse gradient made dense for torch's Adam (it takes no sparse gradients)."""
    for p in model.parameters():
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.to_dense()


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
                  settings: Dict[str, Any]) -> Strategy:
    """One step through a DeepSpeed engine (stock or with the EmbRace hook); a stock engine's
    phases on a timeline of the strategy's own (EmbRace's hook keeps its own)."""
    call = _CallThrough(engine, model)
    hook = getattr(engine, "embrace", None)
    tracer = None if hook is not None else Tracer(rank=engine.global_rank)
    backward = _Backward(tracer, model) if tracer is not None else None

    def phase(label: str) -> Any:
        if tracer is None:
            return contextlib.nullcontext()
        return backward.phase() if label == "backward" else tracer.phase(label)

    def ds_step(batch: Dict[str, Any], next_batch: Optional[Dict[str, Any]] = None) -> float:
        with phase("forward"):
            loss = _loss(criterion, call, batch)
        if hook is not None and hook.relaxed is not None:
            hook.next_batch(next_batch)  # the rows the next batch reads go first
        with phase("backward"):
            engine.backward(loss)  # stock: reduces here (the sparse gradient by all-gather)
        with phase("step"):
            _densify(model)
            engine.step()
        return float(loss.detach())

    return Strategy(name, model, ds_step, engine=engine, extra={"optimizer": opt, "criterion": criterion},
                    own_tracer=tracer, settings=settings)


def _deepspeed_stock(name: str, w: W.Workload, task: Any, data, sparse: bool, zero_stage: int = 0) -> Strategy:
    """The stock model under the stock engine; ``sparse``: its token table sparse;
    ``zero_stage`` 1 or 2: ZeRO with :func:`zero_tuning`."""
    import deepspeed

    criterion = W.build_criterion(w, task)
    model = W.build_model(w, w.stock_arch, task, data)
    if sparse:
        # the first table (a tied one's gradient is dense anyway: the output projection's adds to it)
        W.token_table_module(model, w).sparse = True
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    zero = {"stage": zero_stage, **zero_tuning(w)} if zero_stage else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(None, ROWS_PER_RANK, zero))
    settings = _settings(w, zero_optimization=zero or {"stage": 0})
    return _on_deepspeed(name, model, criterion, engine, opt, settings)


NO_OVERLAP = {"overlap": False, "model_level": False, "tensor_level": False}
FIFO_OVERLAP = {"model_level": False, "tensor_level": False}


def _embrace(name: str, w: W.Workload, task: Any, data, schedule: Any, trace_prefix: Optional[str],
             shard_layout: Optional[str] = None, zero_stage: int = 0, output: Optional[str] = None,
             model: Optional[torch.nn.Module] = None) -> Strategy:
    """The EmbRace architecture on DeepSpeed with the EmbRace hook, the 2D schedule on
    (``schedule`` True), off (False) or set by these ``"embrace"`` keys (a dict);
    ``shard_layout``: the ``"embrace"`` section's layout (None: the default);
    ``zero_stage`` 1: the dense layers under ZeRO-1 with :func:`zero_tuning`;
    ``output``: ``--embrace-output`` for a tied output layer (None: the default, ``auto``);
    ``model``: one built already (default: the EmbRace architecture, every table sharded)."""
    from embrace_fairseq.deepspeed_adapter import initialize
    from embrace_fairseq.fairseq_adapter.vocab_parallel_criteria import configure

    criterion = W.build_criterion(w, task)
    if model is None:
        model = W.build_model(w, w.embrace_arch, task, data,
                              extra_args=("--embrace-output", output) if output is not None else ())
    configure(model, criterion)  # what fairseq's Trainer does: a tied output read vocab-parallel when cheaper
    section: Dict[str, Any] = dict(schedule) if isinstance(schedule, dict) else ({} if schedule else dict(NO_OVERLAP))
    for key, value in embrace_buckets(w).items():
        section.setdefault(key, value)
    if trace_prefix:
        section["trace"] = trace_prefix
    if shard_layout is not None:
        section["shard_layout"] = shard_layout
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    zero = {"stage": zero_stage, **zero_tuning(w)} if zero_stage else None
    engine, *_ = initialize(model=model, optimizer=opt, config=_ds_config(section, ROWS_PER_RANK, zero))
    settings = _settings(w, embrace={k: v for k, v in section.items() if k != "trace"}, zero_optimization=zero)
    return _on_deepspeed(name, model, criterion, engine, opt, settings)


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


def build_sparse_allgather_overlap(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                                   trace_prefix: Optional[str] = None) -> Strategy:
    return _fairseq_ddp(name, "c10d", w, task, data, sparse=True)


def build_embrace_auto(name: str, w: W.Workload, task: Any, data, counter: CollectiveCounter,
                       trace_prefix: Optional[str] = None) -> Strategy:
    """The default plan: the EmbRace architecture built with ``--embrace-plan auto`` (its
    probe measures the link the bench has set now, so the run builds it once that link is
    in place) and ``--max-tokens`` the workload's tokens per rank (what the plan prices).
    Nothing sharded: the stock modules under fairseq's c10d, as fairseq-train runs them.
    Else the EmbRace hook on DeepSpeed with the plan's schedule (off: whole buckets during
    the backward, as DDP) and its bucket and piece sizes, scaled with the model as every
    strategy's are. The plan is recorded in the strategy's settings."""
    model = W.build_model(w, w.embrace_arch, task, data,
                          extra_args=("--embrace-plan", "auto", "--max-tokens", str(w.tokens_per_rank)))
    plan = model.embrace_plan
    if plan is None or not plan.sharded:
        strategy = _fairseq_ddp(name, "c10d", w, task, data, model=model)
    else:
        scale = float(bucket_settings(w)["scale"])
        section: Dict[str, Any] = {"bucket_bytes": max(1, int(plan.bucket_bytes * scale))}
        if plan.schedule:
            section["piece_bytes"] = max(1, int((plan.piece_bytes or plan.bucket_bytes) * scale))
        else:
            section.update(FIFO_OVERLAP)
        strategy = _embrace(name, w, task, data, section, trace_prefix, model=model)
    strategy.settings["plan"] = plan.record() if plan is not None else None
    return strategy


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
