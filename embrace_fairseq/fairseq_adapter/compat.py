"""Small fixes that let stock fairseq (``fairseq-fixed`` 0.12.3.1) run on CPU under torchrun
and load its checkpoints under torch >= 2.6.

:func:`apply` installs them; it is idempotent and runs when ``--user-dir user_dir`` is imported,
which fairseq does while parsing arguments, i.e. before any of the patched functions is called.
Each fix wraps one fairseq function and leaves single-process runs alone. On machines with
CUDA devices fairseq's own code keeps running; only the torchrun world-size rules of fix 1
(world size 1 no longer ignores torchrun; a contradicting explicit value is an error) apply
there too:

1. torchrun on CPU (:func:`_infer_init_method`, :func:`_infer_torch_distributed_launch_init`).
   fairseq returns early when ``distributed_world_size == 1`` -- the default on CPU -- before it
   reads the torchrun environment, so every process trained alone as rank 0; and its torchrun
   branch computes ``device_id = rank % torch.cuda.device_count()`` (ZeroDivisionError on CPU).
   Now world size, rank and device id come from ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, with
   ``env://`` and no spawning; an explicit ``--distributed-world-size`` that disagrees with
   torchrun's ``WORLD_SIZE`` is an error.
2. fairseq's own spawn on CPU (:func:`_call_main`). It spawns
   ``min(torch.cuda.device_count(), world_size)`` processes -- none on CPU -- or asserts that
   the world size fits the GPU count. Now ``--cpu --distributed-world-size N`` spawns N CPU
   processes on this machine (gloo).
3. ``--ddp-backend c10d`` on CPU (:class:`_DeviceAwareDDP`). fairseq passes
   ``device_ids=[device_id]`` to ``DistributedDataParallel`` whatever the device; torch rejects
   that for CPU modules. The ids are dropped for modules that live on the CPU.
4. Checkpoint loading under ``weights_only=True`` (:func:`fairseq_checkpoint_globals`,
   :func:`_wrap_broadcast_object_slow`). torch >= 2.6 refuses the few non-tensor classes fairseq
   pickles; those of checkpoint files are allowed while a checkpoint is read
   (:mod:`.checkpoint_io`, ``torch.serialization.safe_globals`` around the load), and those of
   the rank-to-rank copy of a resumed checkpoint only while it is received. Nothing is
   allowed process-wide.
5. A peer watchdog (:func:`_wrap_distributed_init`): ranks started without torchrun
   (``--distributed-init-method tcp://... --distributed-rank R``) have no agent to stop
   them when another rank dies; :mod:`embrace_fairseq.guards.watchdog` does
   (``EMBRACE_PEER_TIMEOUT_S``).
6. ``numpy.compat`` under numpy 2 (:func:`_numpy_compat_long`). fairseq reads
   ``np.compat.long`` (numpy 1.x: the builtin ``int``) in ``TokenBlockDataset`` with
   ``--sample-break-mode eos`` (language-model sampling and scoring by sentence) and in
   bucketed ``LanguagePairDataset``; numpy 2 removed the module. A module holding only
   ``long = int`` is provided where numpy has none; numpy 1.x keeps its own.
7. ``--bf16`` without ``torch_xla`` (:func:`_call_main`). fairseq's ``options.py`` turns on its
   TPU mode (``--tpu``) with ``--bf16``; without ``torch_xla`` a distributed run stopped in
   ``distributed_init`` on ``'NoneType' object has no attribute 'xrt_world_size'`` (seen on a
   GPU). Now it stops before anything starts, naming the flag and what to use on GPUs.
8. ``fairseq-hydra-train`` imports the user dir only after it has set up the ranks, so fix 1
   comes too late there and each torchrun process would train alone as rank 0.
   :func:`refuse_late_import` stops such a process, naming ``embrace-hydra-train``, which
   loads the plugin first (:mod:`.hydra_train`).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.process_group import free_port
from embrace_fairseq.guards import one_line_errors

logger = logging.getLogger(__name__)

# Marks a function or class installed here, so apply() never wraps twice.
_MARK = "_embrace_compat"

_TORCHRUN_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def _mark(obj: Any) -> Any:
    setattr(obj, _MARK, True)
    return obj


def _is_ours(obj: Any) -> bool:
    return getattr(obj, _MARK, False)


def _no_cuda() -> bool:
    return torch.cuda.device_count() == 0


# --------------------------------------------------------------------------- 1. torchrun


@dataclass(frozen=True)
class TorchrunEnv:
    """The rendezvous variables torchrun (or ``torch.distributed.launch``) sets for a rank."""

    world_size: int
    rank: int
    local_rank: int


def torchrun_env(environ: Optional[dict] = None) -> Optional[TorchrunEnv]:
    """The torchrun variables of this process, or None when it was not started by torchrun.

    Same test as fairseq's own (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK all set);
    ``LOCAL_RANK`` defaults to 0 for launchers that do not set it.
    """
    env = os.environ if environ is None else environ
    if not all(k in env for k in _TORCHRUN_KEYS):
        return None
    return TorchrunEnv(
        world_size=int(env["WORLD_SIZE"]),
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
    )


_WORLD_SIZE_FLAG = "--distributed-world-size"
# fairseq-hydra-train spells the same setting as a hydra override.
_WORLD_SIZE_OVERRIDE = re.compile(r"^\+{0,2}distributed_training\.distributed_world_size=")


def world_size_given_on_command_line(argv: Optional[Sequence[str]] = None) -> bool:
    """Whether the user set the world size explicitly (``sys.argv`` by default).

    fairseq's parsed config cannot tell an explicit ``--distributed-world-size 1`` from the
    default (``max(1, cuda devices)``, i.e. 1 on CPU), so the command line is read. fairseq's
    parsers are built with ``allow_abbrev=False``: only the full flag counts.
    """
    args = sys.argv[1:] if argv is None else argv
    for a in args:
        if a == "--":
            break
        if a == _WORLD_SIZE_FLAG or a.startswith(_WORLD_SIZE_FLAG + "="):
            return True
        if _WORLD_SIZE_OVERRIDE.match(a):
            return True
    return False


def _check_world_size(cfg: Any, env: TorchrunEnv) -> None:
    """Stop early and clearly if the command line contradicts torchrun about the world size.

    Stock fairseq silently replaces the value with ``WORLD_SIZE`` (or, when it is 1, ignores
    torchrun altogether); either way the job is not the one the user asked for.
    """
    if world_size_given_on_command_line() and cfg.distributed_world_size != env.world_size:
        raise ValueError(
            f"--distributed-world-size {cfg.distributed_world_size} disagrees with torchrun, "
            f"which started WORLD_SIZE={env.world_size} processes. Under torchrun the world size "
            "comes from the launcher: drop --distributed-world-size, or change torchrun's "
            "--nproc_per_node/--nnodes to match it."
        )


def _wrap_infer_torch_distributed_launch_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _infer_torch_distributed_launch_init(cfg: Any) -> None:
        # fairseq computes device_id = rank % torch.cuda.device_count(): a ZeroDivisionError
        # without CUDA. There the device id is only a process index, so take torchrun's
        # LOCAL_RANK; the other fields are set exactly as fairseq does.
        if not _no_cuda():
            return orig(cfg)
        env = torchrun_env()
        assert env is not None, "called without a torchrun environment"
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = env.world_size
        cfg.distributed_rank = env.rank
        cfg.device_id = env.local_rank
        # processes are created by torchrun
        cfg.distributed_no_spawn = True

    return _mark(_infer_torch_distributed_launch_init)


def _wrap_infer_init_method(orig: Callable, du: Any) -> Callable:
    @functools.wraps(orig)
    def _infer_init_method(cfg: Any, force_distributed: bool = False) -> None:
        env = torchrun_env()
        if env is None or cfg.distributed_init_method is not None or cfg.tpu:
            return orig(cfg, force_distributed)
        _check_world_size(cfg, env)
        if _no_cuda() and not cfg.pipeline_model_parallel and not (
            env.world_size == 1 and cfg.distributed_world_size == 1
        ):
            # No CUDA: fairseq's tail would call torch.cuda.set_device(device_id), which does
            # not exist in CPU builds; the torchrun fields are all there is to set.
            du._infer_torch_distributed_launch_init(cfg)
            return None
        if cfg.distributed_world_size == 1 and env.world_size > 1:
            # fairseq returns early for world size 1 -- the default with one or no GPU --
            # before looking at torchrun, and each rank then trains alone as rank 0.
            # Any other value already leads fairseq to take WORLD_SIZE from the environment.
            cfg.distributed_world_size = env.world_size
        return orig(cfg, force_distributed)

    return _mark(_infer_init_method)


# --------------------------------------------------------------------------- 2. spawn on CPU


class TpuModeWithoutXlaError(UserError, ValueError):
    """fairseq's TPU mode (``--tpu``, which ``--bf16`` implies) on a machine without torch_xla."""


def _refuse_tpu_mode_without_xla(cfg: Any) -> None:
    if not cfg.common.tpu or importlib.util.find_spec("torch_xla") is not None:
        return
    flag = "--bf16 turns on fairseq's TPU mode (--tpu)" if cfg.common.bf16 else "--tpu is fairseq's TPU mode"
    raise TpuModeWithoutXlaError(
        f"{flag}, and torch_xla is not installed: fairseq trains bf16 on TPUs only. On GPUs train "
        "with --fp16, or in bf16 with DeepSpeed (embrace-ds-train and a "
        "DeepSpeed config with \"bf16\")")


class CpuSpawnError(UserError, ValueError):
    """``--cpu --distributed-world-size N`` with flags that spawning CPU ranks cannot honour."""


def _wrap_call_main(orig: Callable, du: Any) -> Callable:
    @functools.wraps(orig)
    def _call_main(cfg: Any, main: Callable, **kwargs: Any) -> None:
        # a user error ends main with one line, here or in each spawned rank
        main = one_line_errors.guarded(main)
        _refuse_tpu_mode_without_xla(cfg)
        dt = cfg.distributed_training
        spawn_on_cpu = (
            # a CPU job: no GPU, or --cpu on a machine that has one (fairseq would spawn
            # one process per GPU, and assert the world size fits them)
            (_no_cuda() or cfg.common.cpu)
            and not cfg.common.tpu
            and dt.distributed_world_size > 1
            and not dt.distributed_no_spawn
            and not dt.pipeline_model_parallel
            and torchrun_env() is None
            # Slurm or another launcher started the processes: leave it to fairseq.
            and "SLURM_STEP_NODELIST" not in os.environ
            and "SLURM_JOB_NODELIST" not in os.environ
        )
        if not spawn_on_cpu:
            return orig(cfg, main, **kwargs)
        # fairseq would spawn min(torch.cuda.device_count(), world_size) == 0 processes (or
        # assert the world size fits the GPUs): nothing trains. On CPU, spawning means one
        # machine running the whole job, so spawn world_size processes here.
        if dt.distributed_rank not in (None, 0):
            raise CpuSpawnError(
                "spawning CPU processes covers one machine (ranks 0..world_size-1), but "
                f"--distributed-rank is {dt.distributed_rank}; start multi-machine CPU jobs "
                "with torchrun (--nnodes/--node_rank)."
            )
        if dt.distributed_backend == "nccl":
            raise CpuSpawnError(
                "NCCL needs GPUs; for a CPU job pass --distributed-backend gloo"
            )
        if dt.distributed_init_method is None:
            port = dt.distributed_port if dt.distributed_port > 0 else free_port()
            dt.distributed_init_method = f"tcp://localhost:{port}"
        logger.info(
            "spawning %d CPU processes (%s, %s)",
            dt.distributed_world_size, dt.distributed_backend, dt.distributed_init_method,
        )
        dt.distributed_num_procs = dt.distributed_world_size
        dt.distributed_rank = None  # distributed_main assigns start_rank + process index
        kwargs["start_rank"] = 0
        torch.multiprocessing.spawn(
            fn=du.distributed_main,
            args=(main, cfg, kwargs),
            nprocs=dt.distributed_world_size,
            join=True,
        )
        return None

    return _mark(_call_main)


# --------------------------------------------------------------------------- 3. c10d DDP


def _make_device_aware_ddp(ddp_cls: type) -> type:
    class _DeviceAwareDDP(ddp_cls):  # type: ignore[misc, valid-type]
        """``DistributedDataParallel`` ignoring ``device_ids``/``output_device`` for CPU modules.

        fairseq's c10d backend always passes ``device_ids=[cfg.device_id]``; torch only accepts
        device ids for single-device CUDA modules and raises ValueError for CPU ones, where
        ``None`` is the documented value. Modules on an accelerator keep their ids.
        """

        def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                     output_device: Any = None, *args: Any, **kwargs: Any) -> None:
            if _module_on_cpu(module):
                device_ids, output_device = None, None
            super().__init__(module, device_ids, output_device, *args, **kwargs)

    _DeviceAwareDDP.__name__ = _DeviceAwareDDP.__qualname__ = ddp_cls.__name__
    return _mark(_DeviceAwareDDP)


def _module_on_cpu(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


# --------------------------------------------------------------------------- 4. torch.load


def fairseq_checkpoint_globals() -> List[Any]:
    """The non-tensor globals of fairseq checkpoint files, allow-listed for ``weights_only``.

    Found by saving checkpoints with ``fairseq-train`` (``transformer``; ``transformer`` with
    ``--eval-bleu --store-ema``; ``transformer_lm``) and listing what their pickles reference
    (``torch.serialization.get_unsafe_globals_in_checkpoint``):

    - ``argparse.Namespace``: the arguments of architectures registered the legacy way
      (``transformer``...) live as a Namespace in ``cfg["model"]`` (and in ``args`` of older
      checkpoints). It only sets attributes.
    - numpy arrays: ``--eval-bleu`` logs n-gram counts as ``np.array`` meters, which are saved
      in ``extra_state["metrics"]`` (``_reconstruct``, ``ndarray``, ``dtype`` and the integer
      dtype class). ``_reconstruct`` is also listed under its numpy 1.x name, which older
      checkpoints use.

    Everything else is tensors, ``OrderedDict`` and builtins, which torch accepts already.
    """
    from embrace_fairseq.guards.safe_load import numpy_globals

    return [argparse.Namespace] + numpy_globals()


def rank_broadcast_globals() -> List[Any]:
    """Globals of the objects fairseq sends from rank to rank with ``torch.save``/``torch.load``.

    ``distributed.utils._broadcast_object_slow`` is how rank 0 hands a loaded checkpoint to the
    other ranks when training resumes; by then ``state["cfg"]`` is an omegaconf ``DictConfig``
    and tensors are replaced by ``_TensorPlaceholder``. Found by pickling that object for a real
    checkpoint. Allowed only while such a broadcast is received, never for files.
    """
    import collections
    import typing

    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    return [
        DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode,
        # DictConfig metadata records key/element types as type objects.
        typing.Any, dict, list, int, collections.defaultdict,
        _TensorPlaceholder,
    ]


def _wrap_broadcast_object_slow(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _broadcast_object_slow(*args: Any, **kwargs: Any) -> Any:
        # The receiving ranks torch.load() what rank 0 torch.save()d a moment ago -- under
        # weights_only=True that fails on omegaconf's DictConfig when a resumed checkpoint is
        # broadcast. Allow exactly those classes, only for this call.
        safe = getattr(torch.serialization, "safe_globals", None)
        if safe is None:  # torch < 2.5: no weights_only default, nothing to allow
            return orig(*args, **kwargs)
        with safe(rank_broadcast_globals() + fairseq_checkpoint_globals()):  # the checkpoint's own too
            return orig(*args, **kwargs)

    return _mark(_broadcast_object_slow)


# --------------------------------------------------------------------------- apply


def _wrap_all_gather_list(orig: Callable, du: Any) -> Callable:
    """fairseq's ``all_gather_list`` (used by fairseq-validate and the slow stats sync)
    allocates ``torch.cuda.ByteTensor`` and pinned memory: it fails on a CPU build.
    Give it CPU buffers of the size it would allocate, then let it run unchanged."""

    @functools.wraps(orig)
    def all_gather_list(data, group=None, max_size=16384):
        if _no_cuda():
            world = du.get_world_size(group=group if group is not None else du.get_global_group())
            wrapper = du.all_gather_list  # the function reads its buffers off this name
            if not hasattr(wrapper, "_buffer") or wrapper._buffer.numel() < max_size * world:
                wrapper._buffer = torch.zeros(max_size * world, dtype=torch.uint8)
                wrapper._cpu_buffer = torch.zeros(max_size, dtype=torch.uint8)
        return orig(data, group=group, max_size=max_size)

    return _mark(all_gather_list)


def _wrap_distributed_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def distributed_init(cfg: Any) -> Any:
        rank = orig(cfg)
        from embrace_fairseq.guards import watchdog

        watchdog.install()
        return rank

    return _mark(distributed_init)


def _numpy_compat_long() -> None:
    import types

    import numpy as np

    try:
        import numpy.compat  # noqa: F401  (numpy 1.x: fairseq's own reference works)
        return
    except ImportError:
        pass
    shim = types.ModuleType("numpy.compat", "numpy 1.x's numpy.compat.long (= int), which fairseq reads")
    shim.long = int
    setattr(shim, _MARK, True)
    np.compat = shim
    sys.modules["numpy.compat"] = shim


def _translation_from_pretrained_bart_args() -> None:
    """fairseq 0.12's ``translation_from_pretrained_bart`` task (mBART fine-tuning) reads
    ``self.args``, which its hydra-era base class no longer sets: every train, generate and
    hub use fails with ``AttributeError`` (upstream issues #3169, #4479; fix PR #4487 not
    merged). Its configuration is ``self.cfg``: give it that name too."""
    from fairseq.tasks.translation_from_pretrained_bart import TranslationFromPretrainedBARTTask as task

    if _is_ours(task.__init__):
        return
    orig = task.__init__

    @functools.wraps(orig)
    def __init__(self, args, src_dict, tgt_dict):
        orig(self, args, src_dict, tgt_dict)
        if not hasattr(self, "args"):
            self.args = self.cfg

    task.__init__ = _mark(__init__)


class LateUserDirError(UserError, RuntimeError):
    """The user dir imported by ``fairseq-hydra-train`` in a torchrun process that trains alone."""


def refuse_late_import(environ: Optional[dict] = None) -> None:
    """Stop a torchrun process of ``fairseq-hydra-train`` that imports the plugin after fairseq
    set it up to train alone (world size 1, no process group) while torchrun started several.

    ``fairseq-train`` imports ``--user-dir`` while parsing its arguments, before it sets up
    the ranks, and ``embrace-hydra-train`` imports the plugin before fairseq's hydra entry:
    neither has ``fairseq_cli.hydra_train`` loaded yet when this runs. Where the process group
    is up (fairseq's own torchrun rules found the ranks: GPUs), nothing is wrong."""
    env = torchrun_env(environ)
    if env is None or env.world_size == 1 or "fairseq_cli.hydra_train" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    raise LateUserDirError(
        f"fairseq-hydra-train loaded the EmbRace user dir after it had set up this process to train "
        f"alone, while torchrun started {env.world_size} processes (fairseq's hydra entry imports "
        "common.user_dir only inside its main). Start it as embrace-hydra-train, with the same "
        "arguments: it loads EmbRace first.")


def apply() -> None:
    """Install the fixes (idempotent). Needs fairseq to be importable."""
    _numpy_compat_long()
    import fairseq.distributed.utils as du
    import fairseq.models.distributed_fairseq_model as dfm

    if not _is_ours(du._infer_torch_distributed_launch_init):
        du._infer_torch_distributed_launch_init = _wrap_infer_torch_distributed_launch_init(
            du._infer_torch_distributed_launch_init
        )
    if not _is_ours(du.infer_init_method):
        du.infer_init_method = _wrap_infer_init_method(du.infer_init_method, du)
    if not _is_ours(du.call_main):
        du.call_main = _wrap_call_main(du.call_main, du)
    if not _is_ours(dfm.DistributedDataParallel):
        dfm.DistributedDataParallel = _make_device_aware_ddp(dfm.DistributedDataParallel)
    if not _is_ours(du.all_gather_list):
        du.all_gather_list = _wrap_all_gather_list(du.all_gather_list, du)
    if not _is_ours(du._broadcast_object_slow):
        du._broadcast_object_slow = _wrap_broadcast_object_slow(du._broadcast_object_slow)
    if not _is_ours(du.distributed_init):
        du.distributed_init = _wrap_distributed_init(du.distributed_init)
    _translation_from_pretrained_bart_args()
