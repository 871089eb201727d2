"""Thin glue between a DeepSpeed engine and the EmbRace core.

What it changes on the engine (the same levers ``PipelineEngine`` uses to take the
reduction over):

* table shards stay out of the initial ``_broadcast_model`` (each rank holds other rows);
* ``enable_backward_allreduce = False``: DeepSpeed no longer reduces after backward.
  Dense gradients are reduced by :class:`ScheduledAllReduce` during backward, in the
  static 2D schedule's order; shard gradients already arrive averaged from
  ``ShardedEmbedding``'s own AlltoAll;
* ``step`` first waits for the all-reduces (accumulation boundary only);
* ``clip_fp32_gradients`` takes the norm over the dense gradients and every rank's
  shards (:mod:`embrace_fairseq.optim.grad_norm`), so all ranks clip alike;
* ``forward``/``backward``/``step`` are timed for the optional trace.

Under ZeRO stages 1 and 2 DeepSpeed's optimizer holds only the dense parameters (ZeRO
partitions every parameter it holds over the ranks; a shard's rows already are) and
DeepSpeed's own reducer averages the dense gradients (stage 1: all-reduce after
backward; stage 2: reduce-scatter from its gradient hooks during backward, each rank
keeping its partition). The 2D schedule does not take over there. The shards are stepped by a
:class:`~embrace_fairseq.optim.shard_optimizer.ShardOptimizer` with the DeepSpeed optimizer's
rule and current hyper-parameters; ZeRO's global gradient norm (clipping, overflow) is
extended by the shards' squared norm, and its clip/unscale factor is applied to them.

Non-finite gradients: at every optimizer step each rank's shard gradients and the
dense gradients are checked (at stage 2 the dense ones in DeepSpeed's gradient
partitions: :mod:`.zero_partitions`), the flags reduced over all ranks. Without fp16 every rank
raises :class:`~embrace_fairseq.optim.grad_norm.NonFiniteGradientError` (a FloatingPointError)
naming the parameters and ranks, before any weight changes. With fp16 DeepSpeed's
skip-step and loss-scale reduction applies, with the overflow decision reduced over all
shards, so every rank skips the same steps.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Any, Dict, Optional

import torch

from embrace_fairseq.core import collectives
from embrace_fairseq.core.relaxed_rows import RelaxedRows
from embrace_fairseq.core.sharded_embedding import finish_pending, job_topology, sharded_embeddings
from embrace_fairseq.core.trace import Tracer
from embrace_fairseq.deepspeed_adapter import grad_glue, zero_partitions
from embrace_fairseq.deepspeed_adapter.config import EmbraceConfig, EmbraceConfigError
from embrace_fairseq.deepspeed_adapter.engine_setup import (  # noqa: F401  (re-exported)
    dense_parameters,
    shards_kept_out_of_broadcast,
    strip_shards_from_optimizer,
    tensor_specs,
    uses_shard_optimizer,
    without_shards,
)
from embrace_fairseq.guards.startup_guard import guard
from embrace_fairseq.optim.grad_norm import nonfinite_gradients, raise_if_nonfinite
from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer, kind_of
from embrace_fairseq.schedule.exchange_marks import scope_grad_exchanges, trace_tables
from embrace_fairseq.schedule.executor import ExchangeGate, ScheduledAllReduce
from embrace_fairseq.schedule.next_forward import NextForwardUpdates
from embrace_fairseq.schedule.plan import Schedule, ScheduleOptions, build_schedule


logger = logging.getLogger(__name__)

#: optimizers whose step is element-wise with per-parameter state: stepping a subset of
#: the parameters later, with the same hyper-parameters, gives the whole step's result
_ELEMENTWISE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def schedule_options(config: EmbraceConfig) -> ScheduleOptions:
    """The 2D schedule's knobs from the ``"embrace"`` section: every field the two share.

    >>> schedule_options(EmbraceConfig(link_bytes_per_s=2.5e8)).link_bytes_per_s
    250000000.0
    """
    shared = {f.name for f in dataclasses.fields(ScheduleOptions)} & {f.name for f in dataclasses.fields(EmbraceConfig)}
    return ScheduleOptions(**{name: getattr(config, name) for name in sorted(shared)})


class EmbraceEngineHook:
    """Takes over gradient reduction of a DeepSpeed engine. Create it with :func:`attach`."""

    def __init__(self, engine: Any, config: EmbraceConfig, shard_groups: Optional[Dict[int, int]] = None) -> None:
        self.engine = engine
        self.config = config
        grad_glue.check_engine(engine)
        module = engine.module
        self.zero_stage = int(engine.zero_optimization_stage())
        self.tracer = Tracer(rank=collectives.rank(), enabled=config.trace is not None)
        self.schedule: Schedule = build_schedule(tensor_specs(module), schedule_options(config))
        # before the hook's first collective: ranks with other "embrace" sections would
        # otherwise meet in collectives of other sizes (the link rate is measured with a
        # piece), which gloo answers with an abort and NCCL with a hang
        guard(module, self.schedule)
        self.tables = sharded_embeddings(module)
        if config.shard_layout is not None:
            for emb in self.tables:  # collective (same tables, same order on every rank); no-op when equal
                emb.set_layout(config.shard_layout)
        if config.exchange is not None or config.ranks_per_node is not None:
            for emb in self.tables:  # collective unless flat (the ranks agree on the nodes)
                emb.set_exchange(config.exchange or emb.exchange, config.ranks_per_node)
        self.shard_optimizer: Optional[ShardOptimizer] = None
        if uses_shard_optimizer(self.zero_stage, config):
            self.shard_optimizer = self._make_shard_optimizer(shard_groups or {})
        self.reducer: Optional[ScheduledAllReduce] = None
        self.gate: Optional[ExchangeGate] = None
        if self.zero_stage == 0:
            self._take_over_reduction(module)
        else:
            grad_glue.extend_zero_norm(self)
            if self.zero_stage == 2:
                zero_partitions.check_before_step(engine)
            if collectives.rank() == 0:
                logger.info("EmbRace at ZeRO stage %d: DeepSpeed reduces the dense gradients (%s), the 2D schedule "
                            "does not apply; the table shards are stepped by the shard optimizer", self.zero_stage,
                            "all-reduce after backward" if self.zero_stage == 1
                            else "reduce-scatter from its gradient hooks during backward")
        self.next_forward: Optional[NextForwardUpdates] = None
        if config.next_forward:
            blocker = self._next_forward_blocker()
            if blocker is None:
                self.next_forward = NextForwardUpdates(module, self.reducer, self.tracer)
                # the checkpoint writer alone may read them: local completion only
                module.register_state_dict_pre_hook(lambda *_: self.next_forward.complete())
            elif collectives.rank() == 0:
                logger.warning("EmbRace next-forward overlap is off, the schedule overlaps the backward only: %s",
                               blocker)
        self.relaxed: Optional[RelaxedRows] = None
        if config.relaxed_embedding:
            # its own group (created and warmed up now, in the same order on every rank):
            # the deferred AlltoAlls run beside the default group's lookups
            self.relaxed = RelaxedRows(self.tables, collectives.new_group(), self.tracer)
        for emb in self.tables:  # model level of the schedule for a tied table's full exchange
            emb.set_table_overlap(config.overlap and self.relaxed is None)
            # the output layer's table gradient behind the dense all-reduce (_step's finish_pending)
            emb.set_defer_output_grad(config.overlap and config.defer_output_grad)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._last_clip_scale = 1.0
        #: ZeRO stage 0: the global gradient norm (dense and all shards) at the last
        #: optimizer step, taken after the reduction (None in relaxed mode, where some
        #: shard rows arrive later)
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._weights_loaded = False
        module.register_load_state_dict_post_hook(self._on_weights_loaded)
        trace_tables(self.tables, self.tracer)
        scope_grad_exchanges(self.tables, self.gate, self._reducing_backward)
        self._wrap_engine()
        self._closed = False
        if config.trace is not None:
            atexit.register(self.close)

    def _take_over_reduction(self, module: torch.nn.Module) -> None:
        """ZeRO stage 0: the scheduled all-reduce replaces DeepSpeed's reduction."""
        # its own group, created and warmed up now (all ranks, same order)
        group = collectives.new_group()
        # model level: the embedding exchange goes before any dense piece not yet issued
        on = self.config.model_level and self.config.overlap and self.config.exchange_gate
        self.gate = ExchangeGate() if on else None
        self.reducer = ScheduledAllReduce(
            dense_parameters(module), self.schedule, group, overlap=self.config.overlap,
            active=self._reducing_backward, tracer=self.tracer, gate=self.gate, live_queue=self.config.live_queue,
            topology=job_topology(self.tables), two_level=self.config.two_level_allreduce, module=module)
        self.engine.enable_backward_allreduce = False

    def _next_forward_blocker(self) -> Optional[str]:
        """Why the step must wait for every dense gradient here (None: it need not)."""
        e = self.engine
        basic = e.basic_optimizer if e.basic_optimizer is not None else e.optimizer
        if self.reducer is None:
            return f"ZeRO stage {self.zero_stage} reduces the dense gradients itself"
        if not self.config.overlap:
            return '"overlap" is off'
        if e.fp16_enabled() or e.bfloat16_enabled():
            return "fp16/bf16 step fp32 master weights as a whole (overflow check, master copy)"
        if e.gradient_clipping() > 0:
            return "global-norm gradient clipping needs every gradient before any update"
        if self.config.relaxed_embedding:
            return "not combined with the relaxed embedding dependency yet"
        if type(basic) not in _ELEMENTWISE_OPTIMIZERS or any(g.get("fused") or g.get("capturable")
                                                               for g in basic.param_groups):
            return f"optimizer {type(basic).__name__} is not a plain torch Adam, AdamW or SGD"
        return None

    def _update_later(self, basic: Any) -> Any:
        """The rule a deferred bucket is updated with: ``basic.step()`` on those parameters
        only, with the learning rates of this step (the scheduler moves on meanwhile)."""
        lrs = [g["lr"] for g in basic.param_groups]

        @torch.no_grad()
        def update(params: Any) -> None:
            want = {id(p) for p in params}
            kept, now = [], []
            for g, lr in zip(basic.param_groups, lrs):
                now.append(g["lr"])
                g["lr"] = lr
                for p in g["params"]:
                    if p.grad is not None and id(p) not in want:
                        kept.append((p, p.grad))
                        p.grad = None
            try:
                basic.step()
            finally:
                for g, lr in zip(basic.param_groups, now):
                    g["lr"] = lr
                for p, grad in kept:
                    p.grad = grad

        return update

    def flush(self) -> None:
        """Complete a deferred step's dense updates now (cross-iteration overlap); a no-op
        otherwise. Collective (every rank, same point); runs by itself before a backward.
        A ``state_dict()``, ``summary()`` or ``close()`` completes the updates on its own
        rank only."""
        if self.next_forward is not None:
            self.next_forward.flush()

    # ------------------------------------------------------------------ engine glue
    def _reducing_backward(self) -> bool:
        e = self.engine
        return e.managed_gradient_accumulation() and e.is_gradient_accumulation_boundary()

    def _make_shard_optimizer(self, shard_groups: Dict[int, int]) -> ShardOptimizer:
        e = self.engine
        basic = e.basic_optimizer if e.basic_optimizer is not None else e.optimizer
        held = {id(p) for g in basic.param_groups for p in g["params"]}
        for emb in self.tables:
            if id(emb.weight) in held:
                raise EmbraceConfigError(
                    "a table shard is in DeepSpeed's optimizer under ZeRO/relaxed mode: build the engine with "
                    "embrace_fairseq.deepspeed_adapter.initialize, which keeps shards out of it"
                )
        groups = {shard_groups.get(id(emb.weight), 0) for emb in self.tables}
        if len(groups) > 1:
            raise EmbraceConfigError("all table shards must be in the same optimizer param group")
        self._shard_group = groups.pop() if groups else 0
        return ShardOptimizer([emb.weight for emb in self.tables], kind_of(basic))

    def _shard_hparams(self) -> HyperParams:
        e = self.engine
        basic = e.basic_optimizer if e.basic_optimizer is not None else e.optimizer
        return HyperParams.from_param_group(basic.param_groups[min(self._shard_group, len(basic.param_groups) - 1)])

    def check_gradients(self) -> None:
        """Every rank: stop on a non-finite gradient anywhere (not with fp16, where
        DeepSpeed skips the step). Collective; called at each optimizer step."""
        if self.engine.fp16_enabled():
            return
        named = [(self._names.get(id(p), "?"), p.grad) for p in self.engine.module.parameters() if p.requires_grad]
        raise_if_nonfinite(nonfinite_gradients(named))

    # ------------------------------------------------------------------ engine wrappers
    def _wrap_engine(self) -> None:
        e = self.engine
        forward, backward, step, allreduce = e.forward, e.backward, e.step, e.allreduce_gradients
        tracer = self.tracer

        def checked_allreduce(*args: Any, **kwargs: Any) -> Any:
            # ZeRO moves the dense gradients out of .grad when it reduces them:
            # check them (and the shards) here, at the accumulation boundary.
            if e.is_gradient_accumulation_boundary():
                finish_pending(self.tables)
                self.check_gradients()
            return allreduce(*args, **kwargs)

        def traced_forward(*inputs: Any, **kwargs: Any) -> Any:
            with tracer.phase("forward", step=e.global_steps):
                return forward(*inputs, **kwargs)

        def traced_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.flush()  # what the forward did not complete (layers it skipped)
            if self.relaxed is not None:
                self._join_relaxed()
            with tracer.phase("backward", step=e.global_steps):
                return backward(loss, *args, **kwargs)

        def scheduled_step(*args: Any, **kwargs: Any) -> Any:
            return self._step(step, *args, **kwargs)

        e.forward, e.backward, e.step = traced_forward, traced_backward, scheduled_step
        if self.reducer is None and self.zero_stage < 2:
            # (at stage 2 the gradients are checked in DeepSpeed's partitions at the step:
            # zero_partitions.check_before_step)
            e.allreduce_gradients = checked_allreduce
        e.clip_fp32_gradients = self.clip_gradients

    def _step(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's ``step`` with the reduction finished first and the shards stepped."""
        e, tracer, shard_opt = self.engine, self.tracer, self.shard_optimizer
        # unmanaged accumulation: every step() is a boundary
        boundary = not e.managed_gradient_accumulation() or e.is_gradient_accumulation_boundary()
        if boundary:
            finish_pending(self.tables)
            self.refresh_masters(only_if_loaded=True)
        if boundary and self.next_forward is not None:
            # cross-iteration: every rank checks its own gradients (a non-finite average
            # has a non-finite addend) before any update; the dense ones follow later
            self.check_gradients()
            self.last_grad_norm = None
            basic = e.basic_optimizer if e.basic_optimizer is not None else e.optimizer
            self.next_forward.begin(self._update_later(basic))
        elif boundary and self.reducer is not None:
            self.reducer.finish()
            if self.relaxed is None and not e.fp16_enabled():
                # the check and the norm from one pass over the gradients, one all-reduce
                self.last_grad_norm = grad_glue.checked_global_grad_norm(e, self._names)
            else:
                self.check_gradients()
                self.last_grad_norm = None if self.relaxed is not None else grad_glue.global_grad_norm(e)
        if not boundary or shard_opt is None:
            with tracer.phase("step", step=e.global_steps):
                return step(*args, **kwargs)
        hp = self._shard_hparams()  # before DeepSpeed's step moves the LR scheduler
        with tracer.phase("step", step=e.global_steps):
            if self.relaxed is not None:
                # rows the next batch reads now; the rest on a thread (no clipping here)
                self.relaxed.step(shard_opt, hp)
                out = step(*args, **kwargs)
            else:
                self._last_clip_scale = 1.0
                out = step(*args, **kwargs)
                if getattr(e, "_step_applied", True):
                    shard_opt.step(hp, grad_scale=self._last_clip_scale)
            shard_opt.zero_grad()
        return out

    @torch.no_grad()
    def clip_gradients(self) -> torch.Tensor:
        """DeepSpeed's clipping formula, with the norm taken over all ranks' shards."""
        return grad_glue.clip_gradients(self.engine, self.last_grad_norm)

    # ------------------------------------------------------------------ master copies
    def _on_weights_loaded(self, module: Any, incompatible: Any) -> None:
        self._weights_loaded = True

    def optimizer_state_loaded(self) -> None:
        """The optimizer state (with its fp32 master copies) was loaded after the
        weights: the masters are current, keep them (a refresh from fp16/bf16 weights
        would round them)."""
        self._weights_loaded = False

    def refresh_masters(self, only_if_loaded: bool = False) -> None:
        """Copy the model's weights into the fp32 master copies DeepSpeed's fp16/bf16 and
        ZeRO optimizers keep (made when the engine was built), so that the next step
        starts from weights loaded since (a weights-only checkpoint, a reset optimizer)
        instead of writing the old ones back. Runs at the next step by itself after a
        ``load_state_dict`` of the module unless :meth:`optimizer_state_loaded` said
        the optimizer state came with it; the shard optimizer checks its own masters
        at every step (:meth:`ShardOptimizer.begin_step`)."""
        if only_if_loaded and not self._weights_loaded:
            return
        self._weights_loaded = False
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    # ------------------------------------------------------------------ relaxed dependency
    def next_batch(self, batch: Any) -> None:
        """Tell the hook the ids the next batch looks up (relaxed embedding dependency).
        Collective: every rank calls it once between a forward and its backward.

        ``batch``: a fairseq sample (its ``net_input`` integer tensors), a tensor, or a
        list of tensors; every table gets the same ids (a superset is harmless)."""
        if self.relaxed is None:
            return
        if isinstance(batch, dict):
            src = batch.get("net_input", batch)
            ids = [v for v in src.values() if torch.is_tensor(v) and not v.is_floating_point() and v.dim() >= 1]
        elif torch.is_tensor(batch):
            ids = [batch]
        else:
            ids = [t for t in (batch or []) if torch.is_tensor(t)]
        # ids stay where they are: the all-gather places them on the group's device
        self.relaxed.next_batch([[i.detach() for i in ids] for _ in self.tables])

    def _join_relaxed(self) -> None:
        """Wait for the deferred rows; stop every rank on a non-finite deferred gradient."""
        assert self.relaxed is not None
        self.relaxed.wait()
        bad = set(self.relaxed.take_nonfinite())
        named = [(f"deferred rows of table {i}", torch.tensor([float("nan") if f"ShardedEmbedding[{i}]" in bad else 0.0]))
                 for i in range(len(self.tables))]
        raise_if_nonfinite(nonfinite_gradients(named))

    # ------------------------------------------------------------------ results
    def summary(self) -> Dict[str, Any]:
        """Bytes by kind and the hidden share of communication (from the trace)."""
        if self.next_forward is not None:
            self.next_forward.complete()
        return self.tracer.summary()

    def close(self) -> Optional[str]:
        """Write the trace (when configured) and return its path."""
        if getattr(self, "relaxed", None) is not None:
            self.relaxed.wait()
        if getattr(self, "next_forward", None) is not None:
            self.next_forward.complete()
        if getattr(self, "_closed", True) or self.config.trace is None:
            return None
        self._closed = True
        return self.tracer.save(self.config.trace)


def attach(engine: Any, config: Optional[EmbraceConfig] = None, shard_groups: Optional[Dict[int, int]] = None) -> EmbraceEngineHook:
    """Hook an existing engine. The engine must have been built inside
    :func:`shards_kept_out_of_broadcast` (``initialize`` does both) and, under ZeRO or
    relaxed mode, without the table shards in its optimizer. Collective: starts the peer
    watchdog and raises ``ConfigMismatchError`` on every rank when the ranks' schedules or
    dense weights differ, before any other collective of the hook."""
    return EmbraceEngineHook(engine, config or EmbraceConfig(), shard_groups)
