"""``embrace-ds-train``: train a fairseq task with the EmbRace DeepSpeed engine.

Reads fairseq's usual training arguments (fairseq's own parser) plus
``--deepspeed-config``; builds the task, model and criterion with fairseq; iterates
fairseq's epoch iterator sharded by rank; steps with the engine from
:func:`embrace_fairseq.deepspeed_adapter.initialize`. Checkpoints are written in
fairseq's format (``cfg``, full-table ``model``, ...) so ``fairseq-generate --user-dir
user_dir`` reads them. Launch with ``deepspeed --num_gpus N`` or ``torchrun``.

The optimizer and learning-rate schedule come from the DeepSpeed config ("optimizer",
"scheduler"); fairseq's --optimizer/--lr-scheduler flags are not used. Each rank's loss
is the criterion's loss divided by its sample size (tokens), averaged over ranks by the
engine: a per-rank mean, where fairseq's trainer normalises by the global token count.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

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


def save_checkpoint(path: str, cfg: Any, model: torch.nn.Module, criterion: Any, epoch: int, num_updates: int) -> None:
    """fairseq's checkpoint layout with full tables. Collective (gathers the tables);
    rank 0 writes."""
    from fairseq.file_io import PathManager
    from omegaconf import OmegaConf

    from embrace_fairseq.sharded_embedding import consolidate

    consolidate(model)
    state = model.state_dict()
    if dist.get_rank() == 0:
        ckpt = {
            # a plain container, as fairseq's trainer saves it (loadable with weights_only)
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if OmegaConf.is_config(cfg) else cfg,
            "args": None,
            "model": {k: v.detach().cpu() for k, v in state.items()},
            "criterion": None,
            "optimizer_history": [{
                "criterion_name": criterion.__class__.__name__,
                "optimizer_name": "DeepSpeedEngine",
                "lr_scheduler_state": {},
                "num_updates": num_updates,
            }],
            "task_state": {},
            "extra_state": {"train_iterator": {"epoch": epoch}, "metrics": {}},
            "last_optimizer_state": None,
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with PathManager.open(tmp, "wb") as f:
            torch.save(ckpt, f)
        os.replace(tmp, path)
        logger.info("saved %s (epoch %d, %d updates)", path, epoch, num_updates)
    dist.barrier()


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO, stream=sys.stdout)
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (compat fixes + EmbRace architectures)
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from embrace_fairseq.deepspeed_adapter import initialize  # absolute: also runs as a script (deepspeed launcher)

    args = options.parse_args_and_arch(get_parser(), input_args=argv)
    cpu = bool(args.cpu) or not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _init_distributed(cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    # fairseq's parser saw no world size: record the real one so the saved cfg is truthful
    args.distributed_world_size, args.distributed_rank = world, rank
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)

    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)  # after init: ShardedEmbedding spans the world
    criterion = task.build_criterion(cfg.criterion)
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    model.to(device)
    criterion.to(device)
    engine, *_ = initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=args.deepspeed_config
    )
    logger.info("rank %d/%d: %s, %d parameters on this rank", rank, world, cfg.model._name,
                sum(p.numel() for p in model.parameters()))

    task.load_dataset(cfg.dataset.train_subset, combine=False, epoch=1)
    max_epoch = cfg.optimization.max_epoch or math.inf
    max_update = cfg.optimization.max_update or math.inf
    save_dir = cfg.checkpoint.save_dir
    num_updates, epoch, last_sample = 0, 1, None
    epoch_itr = _epoch_iterator(task, cfg, model, rank, world, 1)
    start = time.time()
    while epoch <= max_epoch and num_updates < max_update:
        # every rank gets the same number of batches (short shards are padded with
        # empty ones), so every rank takes part in every collective
        itr = epoch_itr.next_epoch_itr(shuffle=True)
        for sample in itr:
            empty = not sample
            if empty:
                if last_sample is None:
                    raise RuntimeError("the first batch of a shard is empty: use a larger training set or fewer ranks")
                sample = last_sample
            sample = _move(sample, device)
            last_sample = sample
            engine.train()
            loss, sample_size, log = criterion(engine, sample)
            loss = loss / max(sample_size, 1)
            if empty:
                loss = loss * 0.0  # takes part in the collectives, contributes nothing
            engine.backward(loss)
            engine.step()
            num_updates = engine.global_steps
            if rank == 0 and cfg.common.log_interval and num_updates % cfg.common.log_interval == 0:
                logger.info("epoch %d | update %d | loss %.4f | %.1f s", epoch, num_updates,
                            float(loss.detach()) / math.log(2), time.time() - start)
            if num_updates >= max_update:
                break
        if not cfg.checkpoint.no_save and epoch % max(1, cfg.checkpoint.save_interval) == 0:
            save_checkpoint(os.path.join(save_dir, f"checkpoint{epoch}.pt"), cfg, model, criterion, epoch, num_updates)
        epoch += 1
        epoch_itr = _epoch_iterator(task, cfg, model, rank, world, epoch)
    if not cfg.checkpoint.no_save:
        save_checkpoint(os.path.join(save_dir, "checkpoint_last.pt"), cfg, model, criterion, epoch - 1, num_updates)
    hook = engine.embrace
    if rank == 0:
        logger.info("done: %d updates in %.1f s", num_updates, time.time() - start)
    if hook.config.trace is not None:
        logger.info("rank %d communication: %s", rank, hook.summary())
        hook.close()


if __name__ == "__main__":
    main()
