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

Under ZeRO stage 1 DeepSpeed's optimizer holds only the dense parameters (ZeRO
partitions every parameter it holds over the ranks; a shard's rows already are) and
DeepSpeed's own reducer averages the dense gradients. The shards are stepped by a
:class:`~embrace_fairseq.optim.shard_optimizer.ShardOptimizer` with the DeepSpeed optimizer's
rule and current hyper-parameters; ZeRO's global gradient norm (clipping, overflow) is
extended by the shards' squared norm, and its clip/unscale factor is applied to them.

Non-finite gradients: at every optimizer step each rank's shard gradients and the
dense gradients are checked, the flags reduced over all ranks. Without fp16 every rank
raises :class:`~embrace_fairseq.optim.grad_norm.NonFiniteGradientError` (a FloatingPointError)
naming the parameters and ranks, before any weight changes. With fp16 DeepSpeed's
skip-step and loss-scale reduction applies, with the overflow decision reduced over all
shards, so every rank skips the same steps.
"""
from __future__ import annotations

import atexit
import contextlib
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from embrace_fairseq.core.relaxed_rows import RelaxedRows
from embrace_fairseq.optim.grad_norm import (
    combine_norms,
    nonfinite_gradients,
    raise_if_nonfinite,
    sharded_sq_norm,
)
from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer, kind_of
from embrace_fairseq.schedule.executor import ExchangeGate, ScheduledAllReduce
from embrace_fairseq.schedule.plan import Schedule, ScheduleOptions, TensorSpec, build_schedule
from embrace_fairseq.core.sharded_embedding import (
    ShardedEmbedding,
    finish_pending,
    is_sharded_param,
    sharded_embeddings,
)
from embrace_fairseq.core.trace import Tracer, TracingLedger
from embrace_fairseq.deepspeed_adapter.config import EmbraceConfig, EmbraceConfigError


@contextlib.contextmanager
def shards_kept_out_of_broadcast() -> Iterator[None]:
    """While active, ``DeepSpeedEngine._broadcast_model`` skips table shards.

    DeepSpeed's own check skips parameters carrying ``ds_optim_param`` (per-rank
    weights of OptimizedLinear); shards get that mark only for the broadcast.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._broadcast_model

    def _broadcast_model(self) -> None:
        marked = [p for p in self.module.parameters() if is_sharded_param(p) and not hasattr(p, "ds_optim_param")]
        for p in marked:
            p.ds_optim_param = True
        try:
            original(self)
        finally:
            for p in marked:
                del p.ds_optim_param

    DeepSpeedEngine._broadcast_model = _broadcast_model
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original


def uses_shard_optimizer(zero_stage: int, config: EmbraceConfig) -> bool:
    """Whether table shards are stepped outside DeepSpeed's optimizer."""
    return zero_stage >= 1 or config.relaxed_embedding


def without_shards(params: Any) -> List[Any]:
    """``model_parameters`` for DeepSpeed without table shards (tensors or param-group dicts)."""
    out: List[Any] = []
    for item in params:
        if isinstance(item, dict):
            group = dict(item)
            group["params"] = [p for p in item["params"] if not is_sharded_param(p)]
            if group["params"]:
                out.append(group)
        elif not is_sharded_param(item):
            out.append(item)
    return out


def strip_shards_from_optimizer(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """Remove table shards from a client optimizer's param groups (and their state).
    Returns {id(shard): index of the group it was in}, so the shards get that group's
    hyper-parameters."""
    where: Dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        keep = []
        for p in group["params"]:
            if is_sharded_param(p):
                where[id(p)] = gi
                optimizer.state.pop(p, None)
            else:
                keep.append(p)
        group["params"] = keep
    return where


def dense_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Replicated trainable parameters, in registration order (tied ones once)."""
    return [p for p in module.parameters() if p.requires_grad and p.numel() > 0 and not is_sharded_param(p)]


def tensor_specs(module: torch.nn.Module) -> List[TensorSpec]:
    """Schedule inputs: registration order stands for the distance from the input."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        TensorSpec(names.get(id(p), f"param{i}"), p.numel(), p.element_size(), i)
        for i, p in enumerate(dense_parameters(module))
    ]


class EmbraceEngineHook:
    """Takes over gradient reduction of a DeepSpeed engine. Create it with :func:`attach`."""

    def __init__(self, engine: Any, config: EmbraceConfig, shard_groups: Optional[Dict[int, int]] = None) -> None:
        self.engine = engine
        self.config = config
        self._check_engine(engine)
        module = engine.module
        self.zero_stage = int(engine.zero_optimization_stage())
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.tracer = Tracer(rank=rank, enabled=config.trace is not None)
        self.schedule: Schedule = build_schedule(
            tensor_specs(module),
            ScheduleOptions(
                model_level=config.model_level,
                tensor_level=config.tensor_level,
                piece_bytes=config.piece_bytes,
                max_in_flight=config.max_in_flight,
                bucket_bytes=config.bucket_bytes,
            ),
        )
        self.tables = sharded_embeddings(module)
        if config.shard_layout is not None:
            for emb in self.tables:  # collective (same tables, same order on every rank); no-op when equal
                emb.set_layout(config.shard_layout)
        self.shard_optimizer: Optional[ShardOptimizer] = None
        if uses_shard_optimizer(self.zero_stage, config):
            self.shard_optimizer = self._make_shard_optimizer(shard_groups or {})
        self.reducer: Optional[ScheduledAllReduce] = None
        if self.zero_stage == 0:
            # All ranks create it in the same order, so this collective call is safe here.
            group = dist.new_group(ranks=list(range(dist.get_world_size()))) if dist.is_initialized() else None
            # model level: the embedding exchange goes before any dense piece not yet issued
            self.gate = ExchangeGate() if config.model_level and config.overlap else None
            self.reducer = ScheduledAllReduce(
                dense_parameters(module),
                self.schedule,
                group,
                overlap=config.overlap,
                active=self._reducing_backward,
                tracer=self.tracer,
                gate=self.gate,
            )
            engine.enable_backward_allreduce = False
        else:
            self._extend_zero_norm()
        self.relaxed: Optional[RelaxedRows] = None
        if config.relaxed_embedding:
            # its own group: the deferred AlltoAlls run beside the default group's lookups
            rgroup = dist.new_group(ranks=list(range(dist.get_world_size()))) if dist.is_initialized() else None
            self.relaxed = RelaxedRows(self.tables, rgroup, self.tracer)
        for emb in self.tables:  # model level of the schedule for a tied table's full exchange
            emb.set_table_overlap(config.overlap and self.relaxed is None)
        self._names = {id(p): n for n, p in module.named_parameters()}
        if getattr(self, "gate", None) is not None:
            self._gate_tables()
        self._last_clip_scale = 1.0
        self._trace_tables()
        self._wrap_engine()
        self._closed = False
        if config.trace is not None:
            atexit.register(self.close)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_engine(engine: Any) -> None:
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if isinstance(engine, PipelineEngine):
            raise EmbraceConfigError("pipeline parallel engines reduce gradients themselves; EmbRace supports plain data parallelism")
        if engine.zero_optimization_stage() > 1:
            raise EmbraceConfigError(
                f"ZeRO stage {engine.zero_optimization_stage()} is not supported with sharded tables; use stage 0 or 1"
            )
        if engine.bfloat16_enabled() and engine.zero_optimization_stage() == 0:
            raise EmbraceConfigError("bf16 needs ZeRO stage 1 with the EmbRace hook (see config.check_supported)")
        world = engine.dp_world_size
        for emb in sharded_embeddings(engine.module):
            if emb.world_size != world:
                raise EmbraceConfigError(
                    f"a ShardedEmbedding spans {emb.world_size} ranks but the data-parallel world is {world}: "
                    "build the model after torch.distributed is initialised, over the default group"
                )

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

    def _extend_zero_norm(self) -> None:
        """ZeRO's global norm covers the shards too; remember its clip/unscale factor."""
        zopt = self.engine.optimizer
        norm, unscale = zopt.scaled_global_norm, zopt.unscale_and_clip_grads
        tables = self.tables

        def scaled_global_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
            dense = norm(*args, **kwargs)
            shard_sq = sharded_sq_norm([emb.weight.grad for emb in tables if emb.weight.grad is not None])
            if not torch.is_tensor(dense):
                dense = torch.tensor(float(dense))
            if float(dense) < 0:  # DeepSpeed's marker of an invalid (inf/NaN) norm
                return dense
            total = combine_norms(dense, shard_sq.to(dense.device))
            return torch.where(torch.isfinite(total), total, torch.full_like(total, -1.0)).to(dense.device)

        def unscale_and_clip_grads(grad_groups_flat: Any, total_norm: Any) -> Any:
            combined = float(zopt.loss_scale)
            if zopt.clip_grad > 0.0:
                clip = ((float(total_norm) / combined) + 1e-6) / zopt.clip_grad
                combined = max(clip, 1.0) * combined
            self._last_clip_scale = 1.0 / combined
            return unscale(grad_groups_flat, total_norm)

        zopt.scaled_global_norm = scaled_global_norm
        zopt.unscale_and_clip_grads = unscale_and_clip_grads

    def check_gradients(self) -> None:
        """Every rank: stop on a non-finite gradient anywhere (not with fp16, where
        DeepSpeed skips the step). Collective; called at each optimizer step."""
        if self.engine.fp16_enabled():
            return
        named = [(self._names.get(id(p), "?"), p.grad) for p in self.engine.module.parameters() if p.requires_grad]
        raise_if_nonfinite(nonfinite_gradients(named))

    def _wrap_engine(self) -> None:
        e = self.engine
        forward, backward, step = e.forward, e.backward, e.step
        tracer, reducer, shard_opt = self.tracer, self.reducer, self.shard_optimizer
        allreduce = e.allreduce_gradients

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
            if self.relaxed is not None:
                self._join_relaxed()
            with tracer.phase("backward", step=e.global_steps):
                return backward(loss, *args, **kwargs)

        def scheduled_step(*args: Any, **kwargs: Any) -> Any:
            # unmanaged accumulation: every step() is a boundary
            boundary = not e.managed_gradient_accumulation() or e.is_gradient_accumulation_boundary()
            if boundary:
                finish_pending(self.tables)
            if boundary and reducer is not None:
                reducer.finish()
                self.check_gradients()
            if not boundary or shard_opt is None:
                with tracer.phase("step", step=e.global_steps):
                    return step(*args, **kwargs)
            hp = self._shard_hparams()  # before DeepSpeed's step moves the LR scheduler
            if self.relaxed is not None:
                with tracer.phase("step", step=e.global_steps):
                    # rows the next batch reads now; the rest on a thread (no clipping here)
                    self.relaxed.step(shard_opt, hp)
                    out = step(*args, **kwargs)
                    shard_opt.zero_grad()
                return out
            with tracer.phase("step", step=e.global_steps):
                self._last_clip_scale = 1.0
                out = step(*args, **kwargs)
                if getattr(e, "_step_applied", True):
                    shard_opt.step(hp, grad_scale=self._last_clip_scale)
                shard_opt.zero_grad()
            return out

        e.forward, e.backward, e.step = traced_forward, traced_backward, scheduled_step
        if reducer is None:
            e.allreduce_gradients = checked_allreduce
        e.clip_fp32_gradients = self.clip_gradients

    @torch.no_grad()
    def clip_gradients(self) -> torch.Tensor:
        """DeepSpeed's clipping formula, with the norm taken over all ranks' shards."""
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        dense = [p.grad.detach() for p in params if not is_sharded_param(p)]
        sharded = [p.grad.detach() for p in params if is_sharded_param(p)]
        dense_sq = sum((torch.linalg.vector_norm(g, 2, dtype=torch.float32) ** 2 for g in dense), torch.zeros(()))
        total = combine_norms(dense_sq.sqrt(), sharded_sq_norm(sharded))
        coef = torch.clamp(float(self.engine.gradient_clipping()) / (total + 1e-6), max=1.0)
        if params:
            torch._foreach_mul_([p.grad.detach() for p in params], coef.to(params[0].grad.device))
        return total

    def _gate_tables(self) -> None:
        """Close the gate when a table's looked-up rows get their gradient (the exchange
        starts), open it when the shard gradient is accumulated (it ended)."""
        gate = self.gate
        assert gate is not None

        def arrived(g: torch.Tensor) -> torch.Tensor:
            if self._reducing_backward():
                gate.enter()
                torch.autograd.Variable._execution_engine.queue_callback(gate.release_all)
            return g

        def post(module: ShardedEmbedding, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(arrived)

        for emb in self.tables:
            if emb.is_sharded:
                emb.register_forward_hook(post)
                emb.weight.register_post_accumulate_grad_hook(lambda p: gate.leave())

    def _trace_tables(self) -> None:
        if not self.tracer.enabled:
            return
        for emb in self.tables:
            ledger = TracingLedger(self.tracer, inner=emb.ledger)
            emb.ledger = ledger

            def pre(module: ShardedEmbedding, inputs: Any, ledger: TracingLedger = ledger) -> None:
                ledger.mark()

            def post(module: ShardedEmbedding, inputs: Any, output: Any, ledger: TracingLedger = ledger) -> None:
                # the gradient of the looked-up rows arriving starts the backward exchange
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda g: (ledger.mark(), g)[1])

            emb.register_forward_pre_hook(pre)
            emb.register_forward_hook(post)

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
        self.relaxed.next_batch([[i.detach().cpu() for i in ids] for _ in self.tables])

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
        return self.tracer.summary()

    def close(self) -> Optional[str]:
        """Write the trace (when configured) and return its path."""
        if getattr(self, "relaxed", None) is not None:
            self.relaxed.wait()
        if getattr(self, "_closed", True) or self.config.trace is None:
            return None
        self._closed = True
        return self.tracer.save(self.config.trace)


def attach(engine: Any, config: Optional[EmbraceConfig] = None, shard_groups: Optional[Dict[int, int]] = None) -> EmbraceEngineHook:
    """Hook an existing engine. The engine must have been built inside
    :func:`shards_kept_out_of_broadcast` (``initialize`` does both) and, under ZeRO or
    relaxed mode, without the table shards in its optimizer."""
    return EmbraceEngineHook(engine, config or EmbraceConfig(), shard_groups)
