"""Checkpoint files that are either the old one or the new one, never half of each.

A checkpoint is written to a temporary file in the same directory, flushed to disk
(``fsync``), and renamed over the destination (``os.replace`` is atomic on POSIX);
the directory is synced so the rename itself survives a crash. A process killed in
the middle leaves the previous file untouched. A failed write (disk full, quota,
file size limit) removes the temporary file and raises :class:`CheckpointWriteError`
naming the file and the cause; the previous file is still there.

Each file gets a SHA-256 sidecar (``<file>.sha256``): torch's zip reader notices a
truncated file but loads flipped bytes inside a tensor without complaint. The sidecar
lists the digests the file may have; it is rewritten around the rename (first the new
and the old digest, then the new one alone), so the file matches it whatever moment a
crash hits. Reading (:func:`verify`, :func:`load_checkpoint`) refuses a truncated or
corrupted file with :class:`CorruptCheckpointError`; a file without a sidecar (written
by another tool) is only read.

Sidecar rules. A file that does not match its sidecar is either damaged or was
replaced outside this module (``cp``, ``rsync``, another tool) after the sidecar was
written. The zip container torch writes holds a CRC-32 of every record: a damaged file
fails them (any flipped bit does), a file written whole by another tool passes them.
So on a mismatch the records are checked: intact, the sidecar is stale and is rewritten
for the file (with a warning) instead of refusing a good checkpoint; not intact, the
file is refused with :class:`CorruptCheckpointError`. A sidecar whose checkpoint
is gone (fairseq's ``--keep-*`` cleanup removes old checkpoints with ``os.remove``) is
removed by :func:`remove_orphan_sidecars`, which the fairseq adapter runs after each
save. Reading always uses ``weights_only=True`` (:mod:`.safe_load`).
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import warnings
from typing import Any, BinaryIO, Callable, Sequence

import torch

from embrace_fairseq.guards import safe_load
from embrace_fairseq.core.errors import UserError

SIDECAR = ".sha256"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous file at that path is kept."""


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint file is truncated or corrupted."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_lines(path: str) -> list:
    try:
        with open(path + SIDECAR) as f:
            return [line.split() for line in f if line.strip()]
    except OSError:
        return []


def _read_sidecar(path: str) -> list:
    return [fields[0] for fields in _read_lines(path)]


def zip_records_intact(path: str) -> bool:
    """Whether every record of the zip file ``path`` matches its CRC-32 (False for a
    file that is not a readable zip archive)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except Exception:
        return False


def remove_orphan_sidecars(folder: str) -> list:
    """Remove every ``*.sha256`` in ``folder`` whose checkpoint no longer exists; return them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if name.endswith(SIDECAR) and not os.path.exists(os.path.join(folder, name[: -len(SIDECAR)])):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
            except OSError:
                pass
    return removed


def _write_small(path: str, text: str) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(f)`` on a temporary file and move it to ``path`` atomically."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        new = file_digest(tmp)
        old = (_read_sidecar(path)[:1] or [file_digest(path)])[0] if os.path.exists(path) else None
        # while the rename happens, both the old and the new file are valid
        _write_small(path + SIDECAR, "".join(f"{d}\n" for d in (new, old) if d))
        os.replace(tmp, path)
    except BaseException as exc:
        _failed(tmp, path, exc)
    try:
        _write_small(path + SIDECAR, f"{new}\n")
    except OSError:
        pass  # the sidecar still lists the new digest (with the old one)
    _fsync_dir(folder)


def _failed(tmp: str, path: str, exc: BaseException) -> None:
    """Remove the temporary file; re-raise, an I/O failure as CheckpointWriteError."""
    try:
        os.unlink(tmp)
    except OSError:
        pass
    io_error = _io_error_in_chain(exc)
    if io_error is not None:
        raise CheckpointWriteError(
            getattr(io_error, "errno", None) or errno.EIO,
            f"could not write checkpoint {path}: {_cause(io_error)}; the previous file (if any) is unchanged",
        ) from exc
    raise exc


def _io_error_in_chain(exc: BaseException):
    """The OSError behind ``exc``: torch's zip writer, closing after a failed write,
    raises its own RuntimeError ("unexpected pos") with the OSError as context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) or _is_io_error(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, atomically."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` atomically (``dst`` is the old or the new file, never partial)."""
    with open(src, "rb") as source:
        atomic_write(dst, lambda f: shutil.copyfileobj(source, f, 1 << 20))


def _is_io_error(exc: BaseException) -> bool:
    # torch's zip writer reports a failed write as RuntimeError("... file write failed")
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("write failed" in text or "no space" in text or "file too large" in text)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def verify(path: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``path`` matches its sidecar digest
    (a file without a sidecar passes; a stale sidecar is rewritten: see the module doc)."""
    allowed = _read_sidecar(path)
    if not allowed:
        return
    digest = file_digest(path)
    if digest in allowed:
        return
    if zip_records_intact(path):
        warnings.warn(f"{path} was replaced after its {SIDECAR} sidecar was written (its records are intact): "
                      "the sidecar is rewritten for it", RuntimeWarning)
        try:
            _write_small(path + SIDECAR, f"{digest}\n")
        except OSError:
            pass
        return
    raise CorruptCheckpointError(
        f"checkpoint {path} ({os.path.getsize(path)} bytes) is corrupted: its SHA-256 does not match "
        f"{os.path.basename(path) + SIDECAR}, written with it, and its records fail their CRC-32. It was not "
        "loaded; restore it from a copy, or resume from an earlier checkpoint (fairseq: --restore-file)."
    )


def load_checkpoint(path: str, allowed_globals: Sequence[Any] = (), **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)`` that refuses a truncated or corrupted file,
    naming it, and a file naming code outside ``allowed_globals``
    (:class:`~embrace_fairseq.guards.safe_load.UnsafeCheckpointError`, nothing run)."""
    verify(path)
    try:
        with open(path, "rb") as f:
            return safe_load.load(f, allowed_globals, name=f"checkpoint {path}", **kwargs)
    except (FileNotFoundError, safe_load.UnsafeCheckpointError):
        raise
    except Exception as exc:
        raise corrupt_error(path, exc) from exc


def corrupt_error(path: str, exc: BaseException) -> BaseException:
    """The error to raise for ``exc`` from reading the checkpoint ``path``.

    Only failures of the file format count as corruption (the zip reader, the unpickler,
    an early end of file); anything else, e.g. a refusal of ``weights_only`` loading or
    an error of the caller's own processing, is returned unchanged.
    """
    import pickle

    text = str(exc)
    if "Weights only load failed" in text:
        return exc
    format_error = (
        isinstance(exc, (EOFError, pickle.UnpicklingError))
        # a file too short for torch's zip check falls to the legacy reader, whose seek fails
        or (isinstance(exc, OSError) and exc.errno == errno.EINVAL)
        or (isinstance(exc, RuntimeError)
            and any(k in text for k in ("PytorchStreamReader", "zip archive", "magic number", "corrupt")))
    )
    if not format_error:
        return exc
    size = os.path.getsize(path) if os.path.exists(path) else 0
    first = text.splitlines()[0] if text else type(exc).__name__
    return CorruptCheckpointError(
        f"checkpoint {path} ({size} bytes) is truncated or corrupted and was not loaded "
        f"({type(exc).__name__}: {first}). Restore it from a copy, or resume from an earlier "
        "checkpoint (fairseq: --restore-file)."
    )
