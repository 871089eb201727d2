"""A user's mistake ends a command with one line, not a traceback.

:func:`install` (called by the fairseq plugin on import and by ``embrace-ds-train``) wraps
``sys.excepthook``: an uncaught :class:`~embrace_fairseq.core.errors.UserError`, or an
error caused by one (fairseq and DeepSpeed re-raise some), prints
``embrace: error[ rank R]: <Kind>: <message>`` on stderr and the process exits with status 1
as before; every other exception keeps its full traceback (a bug needs one).
``EMBRACE_TRACEBACK=1`` brings the traceback back for user errors too.
"""
from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Callable, Optional, Type

from embrace_fairseq.core.errors import UserError

_Hook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], None]


def user_error_of(exc: Optional[BaseException]) -> Optional[UserError]:
    """``exc`` or the first error in its cause/context chain that is a :class:`UserError`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def one_line(exc: UserError) -> str:
    """``embrace: error[ rank R]: Kind: message``, the message's lines joined by spaces."""
    rank = os.environ.get("RANK")
    where = f" rank {rank}" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"embrace: error{where}: {type(exc).__name__}: {message}"


def _hook(previous: _Hook) -> _Hook:
    def excepthook(kind, exc, tb):
        found = user_error_of(exc)
        if found is None or os.environ.get("EMBRACE_TRACEBACK") == "1":
            return previous(kind, exc, tb)
        print(one_line(found), file=sys.stderr, flush=True)

    excepthook.embrace_one_line = True  # type: ignore[attr-defined]
    return excepthook


def install() -> None:
    """Wrap ``sys.excepthook`` once (idempotent)."""
    if not getattr(sys.excepthook, "embrace_one_line", False):
        sys.excepthook = _hook(sys.excepthook)
