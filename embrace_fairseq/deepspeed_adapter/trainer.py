"""fairseq's ``Trainer`` with the EmbRace DeepSpeed engine underneath.

``embrace-ds-train`` runs ``fairseq_cli.train.main`` with this class in place of
fairseq's ``Trainer``: fairseq's loop, logging (``train_inner`` / ``valid`` / ``train``
lines, progress bars, tensorboard), validation, checkpoint naming and stopping rules are
fairseq's own. What DeepSpeed must own is overridden here, nothing else:

* the model fairseq's loop sees (``trainer.model``) is the engine; no DDP wrapper;
* backward, gradient accumulation (``--update-freq`` is DeepSpeed's
  ``gradient_accumulation_steps``), the gradient reduction (the EmbRace hook's 2D schedule,
  or ZeRO-1/2's reducer), clipping and the optimizer step are the engine's;
* fairseq's gradient normalisation is kept: every rank's loss is scaled by
  ``world / (sample size summed over ranks and micro-batches)`` before backward, so after
  the engine averages over ranks the gradient is fairseq's ``sum of losses / sample size``;
* the learning rate: fairseq's ``--lr-scheduler`` sets it on DeepSpeed's optimizer after
  every update (unless the DeepSpeed config has a ``"scheduler"``, which then owns it);
* checkpoints: full tables, the engine's optimizer state, DeepSpeed's counters and
  each rank's RNG (:mod:`.checkpoint`), plus fairseq's meters and training time.

Logging outputs are all-reduced over ranks by fairseq's own code, so the logged loss,
nll_loss, ppl, wps, ups, wpb, bsz are fairseq's. ``gnorm`` is the norm of the averaged
gradient over dense parameters and every rank's shards (taken by the hook at ZeRO stage 0,
by ZeRO at stages 1 and 2; not logged with the relaxed embedding dependency, whose deferred rows
arrive after the step).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from fairseq import utils
from fairseq.file_io import PathManager
from fairseq.logging import meters, metrics
from fairseq.optim import lr_scheduler as fairseq_lr_scheduler
from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from fairseq.trainer import Trainer

from embrace_fairseq.core import collectives
from embrace_fairseq.deepspeed_adapter import checkpoint as ds_checkpoint
from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError

logger = logging.getLogger(__name__)


@dataclass
class DeepSpeedSetup:
    """What the launcher prepared before any rank started: the DeepSpeed config (with its
    ``"embrace"`` section) and a client optimizer factory (``--optimizer sgd``) or None."""

    ds_config: Dict[str, Any]
    make_optimizer: Optional[Callable] = None
    cpu: bool = True


def expected_sample_size(criterion: Any, sample: Dict[str, Any]) -> float:
    """The sample size fairseq's criteria return (sentences with ``--sentence-avg``, target
    tokens otherwise), known before the forward so the loss can be scaled before backward."""
    if getattr(criterion, "sentence_avg", False):
        return float(sample["target"].size(0))
    if type(criterion).__name__ == "MaskedLmLoss":  # fairseq's masked_lm: the masked positions
        return float(sample["target"].ne(criterion.padding_idx).sum())
    return float(sample["ntokens"])


def _float(x: Any) -> float:
    return float(x.item() if torch.is_tensor(x) else x)


class EngineOptimizer(FairseqOptimizer):
    """fairseq's view of the engine's optimizer: learning rate get/set on DeepSpeed's
    param groups (what fairseq's LR schedulers drive), backward through the engine with
    fairseq's normalisation. Zeroing, reduction and clipping are the engine's."""

    def __init__(self, cfg: Any, engine: Any) -> None:
        super().__init__(cfg)
        self.engine = engine
        basic = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
        self._optimizer = basic
        #: multiplies every micro-batch loss before backward (set per update)
        self.loss_factor = 1.0

    @property
    def optimizer_config(self) -> Dict[str, Any]:
        return {"lr": self.get_lr()}

    def backward(self, loss: torch.Tensor) -> None:
        hook = self.engine.embrace
        if hook.relaxed is not None:
            # no lookahead in fairseq's loop: every row is deferred and a lookup of a row
            # not yet updated waits for it (same results, less overlap)
            hook.next_batch(None)
        self.engine.backward(loss * self.loss_factor, scale_wrt_gas=False)

    def zero_grad(self) -> None:
        pass  # DeepSpeed zeroes the gradients after its optimizer step

    def all_reduce_grads(self, module: Any) -> None:
        pass  # the engine (EmbRace hook or ZeRO) reduces

    def multiply_grads(self, c: float) -> None:
        raise NotImplementedError("the DeepSpeed trainer scales the loss before backward")

    def clip_grad_norm(self, max_norm: float, aggregate_norm_fn: Any = None) -> torch.Tensor:
        raise NotImplementedError("DeepSpeed clips (\"gradient_clipping\", from --clip-norm)")


class EngineLRSchedule:
    """The DeepSpeed config's ``"scheduler"`` owns the learning rate; fairseq's loop only
    reads it (and it travels in checkpoints)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def step_begin_epoch(self, epoch: int) -> float:
        return self._lr()

    def step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        return self._lr()

    def step_update(self, num_updates: int) -> float:
        return self._lr()

    def state_dict(self) -> Dict[str, Any]:
        return ds_checkpoint.scheduler_state(self.engine)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ds_checkpoint.load_scheduler_state(self.engine, state)


def check_supported(cfg: Any) -> None:
    """fairseq flags the DeepSpeed trainer cannot honour stop start-up."""
    refused = []
    if cfg.common.fp16 or cfg.common.bf16 or cfg.common.amp or cfg.common.memory_efficient_fp16:
        refused.append("--fp16/--bf16/--amp (set \"fp16\"/\"bf16\" in the DeepSpeed config)")
    if cfg.optimization.use_bmuf:
        refused.append("--use-bmuf")
    if cfg.distributed_training.ddp_backend == "fully_sharded":
        refused.append("--ddp-backend fully_sharded")
    if cfg.distributed_training.zero_sharding != "none":
        refused.append("--zero-sharding (use \"zero_optimization\" in the DeepSpeed config)")
    if cfg.common.model_parallel_size != 1 or cfg.distributed_training.pipeline_model_parallel:
        refused.append("model/pipeline parallelism")
    if cfg.ema.store_ema:
        refused.append("--store-ema")
    if len(set(cfg.optimization.update_freq)) > 1:
        refused.append("--update-freq varying per epoch (DeepSpeed's gradient accumulation is one number)")
    if refused:
        raise EmbraceConfigError("not supported with --deepspeed-config: " + "; ".join(refused))


def _init_deepspeed_comm(cpu: bool) -> None:
    """DeepSpeed's comm layer over the process group fairseq started (a world of one when
    fairseq started none)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        from embrace_fairseq.core.process_group import free_port

        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce

    skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")


class DeepSpeedTrainer(Trainer):
    """fairseq's ``Trainer`` whose model is an EmbRace DeepSpeed engine."""

    def __init__(self, cfg: Any, task: Any, model: torch.nn.Module, criterion: Any, quantizer: Any = None, *,
                 deepspeed: DeepSpeedSetup) -> None:
        check_supported(cfg)
        if utils.has_parameters(criterion):
            raise EmbraceConfigError(f"criterion {type(criterion).__name__} has parameters: the DeepSpeed engine "
                                     "trains the model's parameters only")
        if quantizer is not None:
            raise EmbraceConfigError("--quantization-config-path is not supported with --deepspeed-config")
        self._setup = deepspeed
        super().__init__(cfg, task, model, criterion, quantizer)
        self._engine = self._build_engine()
        self._wrapped_model = self._engine
        self._wrapped_criterion = self._criterion
        self._gathered: Optional[Dict[str, Any]] = None
        self._gathered_optim_state = None

    # ------------------------------------------------------------------ engine
    @property
    def use_distributed_wrapper(self) -> bool:
        return False  # the engine reduces; fairseq moves model and criterion to the device

    @property
    def engine(self) -> Any:
        return self._engine

    def _build_engine(self) -> Any:
        from embrace_fairseq.deepspeed_adapter import initialize

        _init_deepspeed_comm(self._setup.cpu)
        kwargs: Dict[str, Any] = {}
        if self._setup.make_optimizer is not None:
            kwargs["optimizer"] = self._setup.make_optimizer
        params = [p for p in self._model.parameters() if p.requires_grad]
        engine, *_ = initialize(model=self._model, model_parameters=params, config=self._setup.ds_config, **kwargs)
        logger.info("DeepSpeed engine: ZeRO stage %d, gradient accumulation %d, %d parameters on this rank",
                    engine.zero_optimization_stage(), engine.gradient_accumulation_steps(),
                    sum(p.numel() for p in self._model.parameters()))
        return engine

    def _build_optimizer(self) -> None:
        self._optimizer = EngineOptimizer(self.cfg.optimizer, self._engine)
        if self._engine.lr_scheduler is not None:
            self._lr_scheduler = EngineLRSchedule(self._engine)
        else:
            self._lr_scheduler = fairseq_lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler, self._optimizer)
        self._lr_scheduler.step_update(0)

    # ------------------------------------------------------------------ training
    def _sum_over_ranks(self, value: float) -> float:
        if self.data_parallel_world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        collectives.all_reduce(t)
        return float(t[0])

    def _grad_norm(self) -> Optional[torch.Tensor]:
        norm = self._engine.embrace.last_grad_norm
        if norm is None:
            norm = self._engine.get_global_grad_norm()
        if norm is None:
            return None
        return torch.as_tensor(norm, dtype=torch.float32).detach().cpu()

    @metrics.aggregate("train")
    def train_step(self, samples: List[Any], raise_oom: bool = False) -> Optional[Dict[str, Any]]:
        """One update over ``samples`` (``--update-freq`` micro-batches): fairseq's
        ``train_step`` with DeepSpeed's backward, accumulation and step."""
        self._set_seed()
        self.model.train()
        self.criterion.train()
        metrics.log_start_time("train_wall", priority=800, round=0)
        engine, optimizer = self._engine, self.optimizer
        gas = engine.gradient_accumulation_steps()
        if len(samples) > gas:
            raise ValueError(f"{len(samples)} micro-batches for an update, DeepSpeed accumulates {gas}")
        # an epoch's last group may be short: padded with dummy batches (weight zero) so
        # DeepSpeed's accumulation boundary falls on the last one
        batch = [self._prepare_sample(s) for s in samples] + [self._prepare_sample(None)] * (gas - len(samples))
        sizes = [0.0 if dummy else expected_sample_size(self.get_criterion(), s) for s, dummy in batch]
        total = self._sum_over_ranks(sum(sizes))
        # the engine averages over ranks: world / total gives fairseq's sum / sample size
        optimizer.loss_factor = self.data_parallel_world_size / (total or 1.0)
        logging_outputs, dummy_outputs, sample_size = [], [], 0.0
        for (sample, dummy), expected in zip(batch, sizes):
            loss, size_i, logging_output = self.task.train_step(
                sample=sample, model=self.model, criterion=self.criterion, optimizer=optimizer,
                update_num=self.get_num_updates(), ignore_grad=dummy)
            del loss
            if dummy:
                dummy_outputs.append(logging_output)
            else:
                if _float(size_i) != expected:
                    raise EmbraceConfigError(
                        f"criterion {type(self.get_criterion()).__name__} returned sample size {_float(size_i)} where "
                        f"{expected} (target tokens, or sentences with --sentence-avg) was expected: the DeepSpeed "
                        "trainer needs the sample size before backward")
                logging_outputs.append(logging_output)
                sample_size += _float(size_i)
            engine.step()  # applies the update at the accumulation boundary (the last micro-batch)
        ignore = not logging_outputs
        if ignore:  # every micro-batch was a dummy: take part in the stats all-reduce with zeros
            logging_outputs = dummy_outputs[-1:]
        if self._sync_stats():
            train_time = self._local_cumulative_training_time()
            logging_outputs, (sample_size, _ooms, total_train_time) = self._aggregate_logging_outputs(
                logging_outputs, sample_size, 0, train_time, ignore=ignore)
            self._cumulative_training_time = total_train_time / self.data_parallel_world_size
        logging_output = None
        if getattr(engine, "_step_applied", True):
            self.set_num_updates(self.get_num_updates() + 1)
            grad_norm = self._grad_norm()
            if grad_norm is None:  # relaxed mode (see the module doc): fairseq logs ups with gnorm
                metrics.log_speed("ups", 1.0, priority=100, round=2)
            logging_output = self._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        else:
            logger.info("NOTE: gradient overflow detected, DeepSpeed skipped the update")
        if engine.fp16_enabled():
            scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
            if scale is not None:
                metrics.log_scalar("loss_scale", float(scale), priority=700, round=4, weight=0)
        metrics.log_stop_time("train_wall")
        return logging_output

    # ------------------------------------------------------------------ checkpoints
    def consolidate_optimizer(self) -> None:
        """Before every save, on every rank: gather the full tables, the optimizer states
        and the RNG states (collective; rank 0 keeps them until it has written)."""
        self._gathered = ds_checkpoint.gather_full_state(self._engine, self._model)

    def state_dict(self) -> Dict[str, Any]:
        full, self._gathered = self._gathered, None
        if full is None:
            raise RuntimeError("DeepSpeedTrainer.state_dict on rank 0 needs consolidate_optimizer on every rank first")
        state = ds_checkpoint.build_checkpoint(
            self.cfg, self._engine, self.get_criterion(), full, num_updates=self.get_num_updates(),
            lr_scheduler_state=self.lr_scheduler.state_dict(),
            task_state=self.task.state_dict() if self.task is not None else {},
            save_optimizer_state=not self.cfg.checkpoint.no_save_optimizer_state)
        state["extra_state"].update({"metrics": metrics.state_dict(),
                                     "previous_training_time": self.cumulative_training_time()})
        return state

    def load_checkpoint(self, filename: str, reset_optimizer: bool = False, reset_lr_scheduler: bool = False,
                        optimizer_overrides: Any = None, reset_meters: bool = False) -> Optional[Dict[str, Any]]:
        """fairseq's ``load_checkpoint`` for the engine: every rank reads the file and keeps
        its rows; checkpoints of the earlier ``embrace-ds-train`` loop load too."""
        if not PathManager.isfile(filename):
            logger.info("No existing checkpoint found %s", filename)
            return None
        logger.info("Preparing to load checkpoint %s", filename)
        ckpt = ds_checkpoint.read_checkpoint(filename)
        self._optim_history = ckpt.get("optimizer_history") or []
        last = self._optim_history[-1] if self._optim_history else {}
        reset_optimizer = reset_optimizer or "last_optimizer_state" not in ckpt
        ds_checkpoint.restore(filename, ckpt, self._engine, self._model, reset_optimizer)
        if not reset_optimizer:
            sched_state = last.get("lr_scheduler_state") or {}
            if not reset_lr_scheduler:
                if isinstance(self.lr_scheduler, EngineLRSchedule):
                    self.lr_scheduler.load_state_dict(sched_state)
                elif "embrace_ds" in sched_state:
                    # written when DeepSpeed ran fairseq's schedule as a LambdaLR: fairseq's
                    # scheduler recomputes the rate from the update count
                    logger.info("%s: LR schedule state of the earlier launcher; fairseq's --lr-scheduler "
                                "continues from update %d", filename, last.get("num_updates", 0))
                else:
                    self.lr_scheduler.load_state_dict(sched_state)
            self.model.set_num_updates(last.get("num_updates", 0))
            self.set_num_updates(last.get("num_updates", 0))
        extra_state = ckpt.get("extra_state")
        if extra_state is not None:
            itr_state = extra_state["train_iterator"]
            epoch = itr_state["epoch"]
            if "previous_training_time" in extra_state:
                self._previous_training_time = extra_state["previous_training_time"]
                self._start_time = time.time()
            self.lr_step(epoch)
            if itr_state.get("version", 1) >= 2 and itr_state["iterations_in_epoch"] == 0:
                reset_meters = True
            if extra_state.get("metrics") and not reset_meters:
                metrics.load_state_dict(extra_state["metrics"])
                for meter in metrics.get_meters("default"):
                    if isinstance(meter, meters.TimeMeter):
                        meter.reset()
            logger.info("Loaded checkpoint %s (epoch %d @ %d updates)", filename, epoch, self.get_num_updates())
        return extra_state
