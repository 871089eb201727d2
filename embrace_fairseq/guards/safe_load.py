"""Checkpoints read with ``weights_only=True``: a file cannot run code when it is loaded.

A pickle may name any callable to rebuild an object (``__reduce__``), so loading an
untrusted checkpoint with ``weights_only=False`` runs whatever it names. Every load of
the package goes through :func:`load` (or :func:`allowed`): torch's restricted
unpickler, plus the few classes a checkpoint of ours legitimately holds, allowed only
for the duration of that load (``torch.serialization.safe_globals``), never
process-wide. Anything else stops the load with :class:`UnsafeCheckpointError`, before
any of it is built.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator, List, Sequence

import torch

from embrace_fairseq.core.errors import UserError


class UnsafeCheckpointError(UserError, RuntimeError):
    """A checkpoint names a class or function outside the allow-list; nothing was run."""


def numpy_globals() -> List[Any]:
    """numpy arrays and RNG states (``np.random.get_state()``), as torch pickles them."""
    import numpy as np

    out: List[Any] = [np.ndarray, np.dtype]
    multiarray = getattr(np, "_core", None) or np.core  # numpy >= 2 moved it to numpy._core
    reconstruct = multiarray.multiarray._reconstruct
    out.append(reconstruct)
    if reconstruct.__module__ != "numpy.core.multiarray":
        out.append((reconstruct, "numpy.core.multiarray._reconstruct"))
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles dtypes through these classes
    if dtypes is not None:
        out += [dtypes.Int64DType, dtypes.UInt32DType, dtypes.Float64DType, dtypes.Int32DType, dtypes.Float32DType]
    return out


@contextlib.contextmanager
def allowed(globals_: Sequence[Any] = ()) -> Iterator[None]:
    """Allow ``globals_`` for ``weights_only`` loads inside the ``with`` body only."""
    safe = getattr(torch.serialization, "safe_globals", None)
    if safe is None:  # torch < 2.5
        yield
        return
    with safe(list(globals_)):
        yield


def refusal(source: str, exc: BaseException) -> UnsafeCheckpointError:
    """The error for a ``weights_only`` refusal ``exc`` while loading ``source``."""
    first = str(exc).strip().splitlines()
    detail = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
    return UnsafeCheckpointError(
        f"{source} was not loaded: it refers to code outside the allow-list of checkpoint classes "
        f"({detail}). Loading runs with weights_only=True, so nothing in it was executed. If the file is "
        "trusted and holds a class the package does not know, load it yourself with torch.load."
    )


def is_refusal(exc: BaseException) -> bool:
    return "Weights only load failed" in str(exc)


def load(source: Any, globals_: Sequence[Any] = (), *, name: str = "checkpoint", **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)`` with ``globals_`` allowed for this load.
    ``source``: a path, a file object or ``bytes``. Raises :class:`UnsafeCheckpointError`
    when the file names anything else."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    kwargs.pop("weights_only", None)
    with allowed(globals_):
        try:
            return torch.load(source, weights_only=True, **kwargs)
        except Exception as exc:
            if is_refusal(exc):
                raise refusal(name, exc) from None
            raise
