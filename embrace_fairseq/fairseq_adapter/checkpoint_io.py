"""fairseq's checkpoint files, written atomically and read with a clear error.

fairseq writes a checkpoint to ``<file>.tmp`` and renames it (atomic, but never synced
to disk, and its retry loop writes again into the same, partly written handle), then
*copies* it to the other names (``checkpoint_last.pt``, ``checkpoint_best.pt``) with
``shutil.copyfile``, which is not atomic: a kill during the copy leaves a truncated
``checkpoint_last.pt``, the file the next run resumes from. Here both steps go
through :mod:`embrace_fairseq.guards.atomic_io` (with a SHA-256 sidecar per file), and a
checkpoint that is truncated or does not match its sidecar stops with
:class:`~embrace_fairseq.guards.atomic_io.CorruptCheckpointError` naming the file.

Loading runs with ``weights_only=True`` and the few classes fairseq checkpoints hold
(:func:`~embrace_fairseq.fairseq_adapter.compat.fairseq_checkpoint_globals`) allowed for
that load only; a file naming anything else stops with
:class:`~embrace_fairseq.guards.safe_load.UnsafeCheckpointError`, nothing of it run.
After each save, sidecars whose checkpoint fairseq's ``--keep-*`` cleanup removed are
removed too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from embrace_fairseq.guards import safe_load
from embrace_fairseq.guards.atomic_io import (
    CorruptCheckpointError,
    atomic_copy,
    atomic_save,
    corrupt_error,
    remove_orphan_sidecars,
    verify,
)

_MARK = "_embrace_checkpoint_io"


def _is_local(path: str) -> bool:
    return "://" not in str(path)


def _wrap_persistent_save(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def torch_persistent_save(obj: Any, filename: Any, async_write: bool = False) -> None:
        if async_write or not isinstance(filename, str) or not _is_local(filename):
            return orig(obj, filename, async_write)
        atomic_save(obj, filename)

    setattr(torch_persistent_save, _MARK, True)
    return torch_persistent_save


def _wrap_copy(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if not (_is_local(src_path) and _is_local(dst_path)):
            return orig(src_path, dst_path, overwrite)
        atomic_copy(src_path, dst_path)
        return True

    setattr(copy, _MARK, True)
    return staticmethod(copy)


def _wrap_load(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def load_checkpoint_to_cpu(path: str, *args: Any, **kwargs: Any) -> Any:
        from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals

        if _is_local(path):
            verify(path)  # flipped bytes inside a tensor load silently otherwise
        try:
            with safe_load.allowed(fairseq_checkpoint_globals()):  # for this load only
                return _weights_only(orig)(path, *args, **kwargs)
        except (FileNotFoundError, CorruptCheckpointError):
            raise
        except Exception as exc:
            if safe_load.is_refusal(exc):
                raise safe_load.refusal(f"checkpoint {path}", exc) from None
            if not _is_local(path):
                raise
            err = corrupt_error(path, exc)
            if err is exc:
                raise
            raise err from exc

    setattr(load_checkpoint_to_cpu, _MARK, True)
    return load_checkpoint_to_cpu


def _weights_only(orig: Callable) -> Callable:
    """``orig`` with every ``torch.load`` it makes forced to ``weights_only=True``
    (fairseq passes none, so an environment override could turn it off)."""
    import torch

    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        load = torch.load

        def strict_load(*a: Any, **k: Any) -> Any:
            k["weights_only"] = True
            return load(*a, **k)

        torch.load = strict_load
        try:
            return orig(*args, **kwargs)
        finally:
            torch.load = load

    return call


def _wrap_save_checkpoint(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def save_checkpoint(cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any) -> Any:
        try:
            out = orig(cfg, trainer, epoch_itr, val_loss)
        finally:
            from embrace_fairseq.fairseq_adapter.trainer_glue import release_full_copies

            if hasattr(trainer, "model"):
                release_full_copies(trainer)  # also when no file was due this time
        save_dir = getattr(cfg, "save_dir", None)
        if save_dir and _is_local(save_dir) and getattr(trainer, "should_save_checkpoint_on_current_rank", True):
            remove_orphan_sidecars(save_dir)  # --keep-* removed their checkpoints
        return out

    setattr(save_checkpoint, _MARK, True)
    return save_checkpoint


def apply() -> None:
    """Install the wrappers (idempotent)."""
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    if not getattr(checkpoint_utils.torch_persistent_save, _MARK, False):
        checkpoint_utils.torch_persistent_save = _wrap_persistent_save(checkpoint_utils.torch_persistent_save)
    if not getattr(PathManager.copy, _MARK, False):
        PathManager.copy = _wrap_copy(PathManager.copy)
    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, _MARK, False):
        checkpoint_utils.load_checkpoint_to_cpu = _wrap_load(checkpoint_utils.load_checkpoint_to_cpu)
    if not getattr(checkpoint_utils.save_checkpoint, _MARK, False):
        checkpoint_utils.save_checkpoint = _wrap_save_checkpoint(checkpoint_utils.save_checkpoint)
