"""``embrace-ds-train``: train a fairseq task with the EmbRace DeepSpeed engine.

Reads fairseq's usual training arguments (fairseq's own parser) plus
``--deepspeed-config``; builds the task, model and criterion with fairseq; iterates
fairseq's epoch iterator sharded by rank; steps with the engine from
:func:`embrace_fairseq.deepspeed_adapter.initialize`. Checkpoints are written in
fairseq's format (``cfg``, full-table ``model``, ...) so ``fairseq-generate --user-dir
user_dir`` reads them. Launch with ``deepspeed --num_gpus N`` or ``torchrun``.

Optimizer and learning-rate schedule: the DeepSpeed config's "optimizer"/"scheduler"
when present; otherwise fairseq's flags are mapped (:mod:`.fairseq_options`: --optimizer
adam/sgd, --lr, --adam-betas, --adam-eps, --weight-decay, --momentum, --lr-scheduler
inverse_sqrt/fixed, --warmup-updates, --warmup-init-lr, --clip-norm). A flag given
explicitly that disagrees with the JSON stops start-up. Each rank's loss is the
criterion's loss divided by its sample size (tokens), averaged over ranks by the engine:
a per-rank mean, where fairseq's trainer normalises by the global token count.

Validation on ``--valid-subset`` every ``--validate-interval-updates`` updates and at
each epoch end (unless ``--disable-validation``): the summed loss over all ranks divided
by the summed sample size, in bits, logged as ``valid | epoch E | update U | loss L``.
Checkpoints (:mod:`.checkpoint`): ``checkpoint_last.pt`` at every
``--save-interval-updates`` and epoch end, ``checkpoint_best.pt`` on a new best valid
loss, ``checkpoint{epoch}.pt`` at epoch ends; resumed from ``--restore-file`` (default
``checkpoint_last.pt`` in ``--save-dir``) with the optimizer, LR schedule, step count,
iterator position and RNG state, so a resumed run repeats the uninterrupted run's
losses exactly on CPU. Each update seeds torch's RNG with ``seed + update`` as fairseq's
trainer does.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from embrace_fairseq.core import collectives

logger = logging.getLogger("embrace_fairseq.deepspeed_adapter.train")


def get_parser():
    """fairseq's training parser with the launcher's own options."""
    from fairseq import options

    parser = options.get_training_parser()
    group = parser.add_argument_group("EmbRace DeepSpeed")
    group.add_argument("--deepspeed-config", required=True, metavar="JSON",
                       help="DeepSpeed config, optionally with an \"embrace\" section")
    # fairseq's parser already accepts the --local_rank the deepspeed launcher passes
    return parser


def apply_shard_layout(args: Any, argv: List[str], layout: Optional[str]) -> None:
    """The JSON's ``"embrace.shard_layout"`` becomes ``args.embrace_shard_layout`` (the
    model's tables are built with it); an explicit ``--embrace-shard-layout`` that says
    otherwise stops with :class:`FairseqOptionConflict`."""
    if layout is None:
        return
    flag = getattr(args, "embrace_shard_layout", None)
    given = any(a == "--embrace-shard-layout" or a.startswith("--embrace-shard-layout=") for a in argv)
    if given and flag != layout:
        from embrace_fairseq.deepspeed_adapter.fairseq_options import FairseqOptionConflict

        raise FairseqOptionConflict(
            f"--embrace-shard-layout {flag!r} disagrees with the DeepSpeed config's embrace.shard_layout = "
            f"{layout!r}; give one of them, or the same value")
    args.embrace_shard_layout = layout


def _init_distributed(cpu: bool) -> None:
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    if not cpu and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def _move(sample: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    from fairseq import utils

    return utils.apply_to_sample(lambda t: t.to(device), sample)


def _epoch_iterator(task: Any, cfg: Any, model: torch.nn.Module, rank: int, world: int, epoch: int) -> Any:
    """fairseq's batch iterator over this rank's shard of the training set."""
    from fairseq import utils

    return task.get_batch_iterator(
        dataset=task.dataset(cfg.dataset.train_subset),
        max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=world,
        shard_id=rank,
        num_workers=0,
        epoch=epoch,
    )


def _is_empty(sample: Any) -> bool:
    return not sample or "net_input" not in sample


@torch.no_grad()
def validate(engine: Any, task: Any, criterion: Any, cfg: Any, model: torch.nn.Module, device: torch.device,
             rank: int, world: int, dummy: Any) -> float:
    """Valid loss in bits over the whole valid subset (all ranks). Collective: a rank with
    fewer (or no) batches runs ``dummy`` (a training batch) with weight zero, so every
    rank takes part in every lookup."""
    from fairseq import utils

    subset = cfg.dataset.valid_subset.split(",")[0]
    itr = task.get_batch_iterator(
        dataset=task.dataset(subset),
        max_tokens=cfg.dataset.max_tokens_valid,
        max_sentences=cfg.dataset.batch_size_valid,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=world,
        shard_id=rank,
        num_workers=0,
        epoch=1,
    ).next_epoch_itr(shuffle=False)
    batches = [s for s in itr if not _is_empty(s)]
    count = torch.tensor([len(batches)], dtype=torch.long)
    collectives.all_reduce(count, op="max")  # staged on the group's device (NCCL: the GPU)
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    try:
        for i in range(int(count)):
            real = i < len(batches)
            sample = _move(batches[i], device) if real else dummy
            loss, sample_size, _ = criterion(engine, sample)  # the lookups are collectives: every rank runs them
            if real:
                totals += torch.tensor([float(loss), float(sample_size)], dtype=torch.float64)
    finally:
        engine.train()
    collectives.all_reduce(totals)
    return float(totals[0] / totals[1].clamp_min(1.0) / math.log(2))


def _output_mode(args: Any, argv: List[str], section: Optional[Dict[str, Any]]) -> None:
    """``"output"`` of the ``"embrace"`` section is ``--embrace-output``; both given and
    different stops start-up."""
    if not section or "output" not in section:
        return
    flag = "--embrace-output"
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    current = str(getattr(args, "embrace_output", "auto"))
    if given and current != section["output"]:
        raise ValueError(f'{flag} {current} disagrees with "embrace.output": "{section["output"]}" in the DeepSpeed config')
    args.embrace_output = section["output"]


def _setup(argv: Optional[List[str]]) -> Dict[str, Any]:
    """Parse fairseq's flags and the DeepSpeed config, start DeepSpeed, build task, model,
    criterion and engine. Returns them by name."""
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (compat fixes + EmbRace architectures)
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    # absolute imports: this file also runs as a script (deepspeed launcher)
    from embrace_fairseq.deepspeed_adapter import initialize
    from embrace_fairseq.deepspeed_adapter.config import split_config
    from embrace_fairseq.deepspeed_adapter.fairseq_options import apply_fairseq_options
    from embrace_fairseq.fairseq_adapter.vocab_parallel_criteria import configure as configure_output

    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = options.parse_args_and_arch(get_parser(), input_args=argv)
    cpu = bool(args.cpu) or not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # the config is checked (and fairseq's flags mapped into it) before any rank starts DeepSpeed
    with open(args.deepspeed_config) as f:
        raw = json.load(f)
    section = raw.pop("embrace", None) if isinstance(raw, dict) else None
    _, embrace_cfg = split_config({"embrace": section})  # a bad section stops here, before any rank starts
    _output_mode(args, raw_argv, section)
    apply_shard_layout(args, raw_argv, embrace_cfg.shard_layout)
    ds_config, make_optimizer, make_scheduler = apply_fairseq_options(raw, args, raw_argv, cpu)
    if section is not None:
        ds_config["embrace"] = section
    _init_distributed(cpu)
    rank, world = collectives.rank(), collectives.world_size()
    # fairseq's parser saw no world size: record the real one so the saved cfg is truthful
    args.distributed_world_size, args.distributed_rank = world, rank
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)

    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)  # after init: ShardedEmbedding spans the world
    criterion = task.build_criterion(cfg.criterion)
    configure_output(model, criterion)  # vocab-parallel output layer when the criterion takes it
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    model.to(device)
    criterion.to(device)
    kwargs: Dict[str, Any] = {}
    if make_optimizer is not None:
        kwargs["optimizer"] = make_optimizer
    if make_scheduler is not None:
        kwargs["lr_scheduler"] = make_scheduler
    engine, *_ = initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config, **kwargs
    )
    logger.info("rank %d/%d: %s, %d parameters on this rank", rank, world, cfg.model._name,
                sum(p.numel() for p in model.parameters()))
    task.load_dataset(cfg.dataset.train_subset, combine=False, epoch=1)
    if not cfg.dataset.disable_validation:
        for subset in cfg.dataset.valid_subset.split(",")[:1]:
            task.load_dataset(subset, combine=False, epoch=1)
    return {"cfg": cfg, "task": task, "model": model, "criterion": criterion, "device": device,
            "engine": engine, "rank": rank, "world": world}


class _Trainer:
    """The launcher's loop: epochs of fairseq batches, validation and checkpoints."""

    def __init__(self, built: Dict[str, Any]) -> None:
        from embrace_fairseq.deepspeed_adapter.checkpoint import load_checkpoint, restore_path

        self.__dict__.update(built)
        cfg = self.cfg
        self.validating = not cfg.dataset.disable_validation
        self.epoch_itr = _epoch_iterator(self.task, cfg, self.model, self.rank, self.world, 1)
        self.extra: Dict[str, Any] = {"best_loss": None}
        path = restore_path(cfg)
        if path is not None:
            self.extra = load_checkpoint(path, self.engine, self.model, self.epoch_itr, cfg)
            logger.info("rank %d: resumed from %s at update %d (epoch %d, %d batches in)", self.rank, path,
                        self.engine.global_steps, self.epoch_itr.epoch, self.epoch_itr.iterations_in_epoch)
        self.num_updates = self.engine.global_steps
        self.last_sample = None
        self.start = time.time()
        self.peeked: List[Any] = [False, 0, 0]  # read ahead?, epoch, batches read

    def checkpoint(self, name: str, val_loss: Optional[float] = None) -> None:
        from embrace_fairseq.deepspeed_adapter.checkpoint import save_checkpoint

        self.extra["val_loss"] = val_loss
        itr_state = self.epoch_itr.state_dict()
        if self.peeked[0]:
            # the batch read ahead is not consumed (fairseq would call a fully read epoch done)
            itr_state["epoch"], itr_state["iterations_in_epoch"] = self.peeked[1], self.peeked[2] - 1
        save_checkpoint(os.path.join(self.cfg.checkpoint.save_dir, name), self.cfg, self.engine, self.model,
                        self.criterion, self.epoch_itr, self.extra, itr_state)

    def validate_and_save(self, end_of_epoch: bool) -> None:
        cfg, epoch_itr, extra = self.cfg, self.epoch_itr, self.extra
        val = None
        if self.validating:
            val = validate(self.engine, self.task, self.criterion, cfg, self.model, self.device, self.rank,
                           self.world, self.last_sample)
            if self.rank == 0:
                logger.info("valid | epoch %d | update %d | loss %.4f", epoch_itr.epoch, self.num_updates, val)
        if cfg.checkpoint.no_save:
            return
        if (end_of_epoch and epoch_itr.epoch % max(1, cfg.checkpoint.save_interval) == 0
                and not cfg.checkpoint.no_epoch_checkpoints):
            self.checkpoint(f"checkpoint{epoch_itr.epoch}.pt", val)
        if val is not None and (extra.get("best_loss") is None or val < extra["best_loss"]):
            extra["best_loss"] = val
            self.checkpoint("checkpoint_best.pt", val)
        self.checkpoint("checkpoint_last.pt", val)

    def update(self, sample: Any, upcoming: Any, relaxed: bool) -> Any:
        """One update on ``sample`` (an empty batch repeats the last one with weight zero)."""
        from fairseq import utils

        engine, cfg = self.engine, self.cfg
        empty = _is_empty(sample)
        if empty:
            if self.last_sample is None:
                raise RuntimeError("the first batch of a shard is empty: use a larger training set or fewer ranks")
            sample = self.last_sample
        sample = _move(sample, self.device)
        self.last_sample = sample
        engine.train()
        utils.set_torch_seed(cfg.common.seed + self.num_updates)  # as fairseq's trainer: dropout per update
        loss, sample_size, log = self.criterion(engine, sample)
        if relaxed:
            engine.embrace.next_batch(None if upcoming is None or _is_empty(upcoming) else upcoming)
        loss = loss / max(sample_size, 1)
        if empty:
            loss = loss * 0.0  # takes part in the collectives, contributes nothing
        engine.backward(loss)
        engine.step()
        self.num_updates = engine.global_steps
        return loss

    def run_epoch(self, max_update: float) -> bool:
        """One epoch (or up to ``max_update``); returns whether the update limit was hit."""
        cfg, engine = self.cfg, self.engine
        save_updates = cfg.checkpoint.save_interval_updates or 0
        valid_updates = cfg.dataset.validate_interval_updates or 0
        # every rank gets the same number of batches (short shards are padded with
        # empty ones), so every rank takes part in every collective
        itr = self.epoch_itr.next_epoch_itr(shuffle=True)
        epoch = self.epoch_itr.epoch
        relaxed = engine.embrace.relaxed is not None
        upcoming = next(itr, None) if itr.has_next() else None
        stop = False
        while upcoming is not None:
            sample = upcoming
            # the relaxed embedding dependency is told the next batch: a lookahead of one
            # (checkpoints then record one batch less as consumed)
            upcoming = next(itr, None) if relaxed and itr.has_next() else None
            self.peeked[:] = [upcoming is not None, epoch, itr.n]
            loss = self.update(sample, upcoming, relaxed)
            n = self.num_updates
            if self.rank == 0 and cfg.common.log_interval and n % cfg.common.log_interval == 0:
                logger.info("epoch %d | update %d | loss %r | lr %r | %.1f s", epoch, n,
                            float(loss.detach()) / math.log(2), engine.get_lr()[0], time.time() - self.start)
            stop = n >= max_update
            at_end = not itr.has_next() and upcoming is None
            if not at_end and ((save_updates and n % save_updates == 0) or
                               (valid_updates and n % valid_updates == 0) or stop):
                self.validate_and_save(False)
            if stop:
                break
            if not relaxed:
                upcoming = next(itr, None) if itr.has_next() else None
        stopped_early = self.peeked[0] or itr.has_next()  # max-update reached inside the epoch
        self.peeked[0] = False
        if not stopped_early and self.epoch_itr.end_of_epoch():
            self.validate_and_save(True)
        return stop

    def run(self) -> None:
        max_epoch = self.cfg.optimization.max_epoch or math.inf
        max_update = self.cfg.optimization.max_update or math.inf
        while self.epoch_itr.next_epoch_idx <= max_epoch and self.num_updates < max_update:
            self.run_epoch(max_update)


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, stream=sys.stdout)
    trainer = _Trainer(_setup(argv))
    trainer.run()
    hook = trainer.engine.embrace
    if trainer.rank == 0:
        logger.info("done: %d updates in %.1f s", trainer.num_updates, time.time() - trainer.start)
    if hook.config.trace is not None:
        logger.info("rank %d communication: %s", trainer.rank, hook.summary())
        hook.close()


if __name__ == "__main__":
    main()
