"""fairseq's checkpoint files, written atomically and read with a clear error.

fairseq writes a checkpoint to ``<file>.tmp`` and renames it (atomic, but never synced
to disk, and its retry loop writes again into the same, partly written handle), then
*copies* it to the other names (``checkpoint_last.pt``, ``checkpoint_best.pt``) with
``shutil.copyfile``, which is not atomic: a kill during the copy leaves a truncated
``checkpoint_last.pt``, the file the next run resumes from. Here both steps go
through :mod:`embrace_fairseq.guards.atomic_io` (with a SHA-256 sidecar per file), and a
checkpoint that is truncated or does not match its sidecar stops with
:class:`~embrace_fairseq.guards.atomic_io.CorruptCheckpointError` naming the file.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from embrace_fairseq.guards.atomic_io import (
    CorruptCheckpointError,
    atomic_copy,
    atomic_save,
    corrupt_error,
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
        if _is_local(path):
            verify(path)  # flipped bytes inside a tensor load silently otherwise
        try:
            return orig(path, *args, **kwargs)
        except (FileNotFoundError, CorruptCheckpointError):
            raise
        except Exception as exc:
            if not _is_local(path):
                raise
            err = corrupt_error(path, exc)
            if err is exc:
                raise
            raise err from exc

    setattr(load_checkpoint_to_cpu, _MARK, True)
    return load_checkpoint_to_cpu


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
