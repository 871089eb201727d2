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
  shards (:mod:`embrace_fairseq.grad_norm`), so all ranks clip alike;
* ``forward``/``backward``/``step`` are timed for the optional trace.
"""
from __future__ import annotations

import atexit
import contextlib
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from ..grad_norm import combine_norms, sharded_sq_norm
from ..scheduled_allreduce import ScheduledAllReduce
from ..scheduler import Schedule, ScheduleOptions, TensorSpec, build_schedule
from ..sharded_embedding import ShardedEmbedding, is_sharded_param, sharded_embeddings
from ..trace import Tracer, TracingLedger
from .config import EmbraceConfig, EmbraceConfigError


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

    def __init__(self, engine: Any, config: EmbraceConfig) -> None:
        self.engine = engine
        self.config = config
        self._check_engine(engine)
        module = engine.module
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
        # All ranks create it in the same order, so this collective call is safe here.
        group = dist.new_group(ranks=list(range(dist.get_world_size()))) if dist.is_initialized() else None
        self.reducer = ScheduledAllReduce(
            dense_parameters(module),
            self.schedule,
            group,
            overlap=config.overlap,
            active=self._reducing_backward,
            tracer=self.tracer,
        )
        self.tables = sharded_embeddings(module)
        self._trace_tables()
        engine.enable_backward_allreduce = False
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
        if engine.zero_optimization_stage() != 0:
            raise EmbraceConfigError(
                f"ZeRO stage {engine.zero_optimization_stage()} is not supported with sharded tables; use stage 0"
            )
        if engine.bfloat16_enabled():
            raise EmbraceConfigError("bf16 is not supported by the EmbRace hook yet (see config.check_supported)")
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

    def _wrap_engine(self) -> None:
        e = self.engine
        forward, backward, step = e.forward, e.backward, e.step
        tracer, reducer = self.tracer, self.reducer

        def traced_forward(*inputs: Any, **kwargs: Any) -> Any:
            with tracer.phase("forward", step=e.global_steps):
                return forward(*inputs, **kwargs)

        def traced_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with tracer.phase("backward", step=e.global_steps):
                return backward(loss, *args, **kwargs)

        def scheduled_step(*args: Any, **kwargs: Any) -> Any:
            # unmanaged accumulation: every step() is a boundary
            if not e.managed_gradient_accumulation() or e.is_gradient_accumulation_boundary():
                reducer.finish()
            with tracer.phase("step", step=e.global_steps):
                return step(*args, **kwargs)

        e.forward, e.backward, e.step = traced_forward, traced_backward, scheduled_step
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

    # ------------------------------------------------------------------ results
    def summary(self) -> Dict[str, Any]:
        """Bytes by kind and the hidden share of communication (from the trace)."""
        return self.tracer.summary()

    def close(self) -> Optional[str]:
        """Write the trace (when configured) and return its path."""
        if getattr(self, "_closed", True) or self.config.trace is None:
            return None
        self._closed = True
        return self.tracer.save(self.config.trace)


def attach(engine: Any, config: Optional[EmbraceConfig] = None) -> EmbraceEngineHook:
    """Hook an existing engine. The engine must have been built inside
    :func:`shards_kept_out_of_broadcast` (``initialize`` does both)."""
    return EmbraceEngineHook(engine, config or EmbraceConfig())
