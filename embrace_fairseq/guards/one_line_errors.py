"""A user's mistake ends a command with one line and one exit status, not a traceback.

Every EmbRace command (the console scripts, the ``python -m embrace_fairseq...`` tools, and
fairseq's own commands with the plugin loaded) ends on a user error -- an uncaught
:class:`~embrace_fairseq.core.errors.UserError`, or an error caused by one (fairseq and
DeepSpeed re-raise some) -- by printing::

    embrace: error: [(rank R) ]<Kind>: <message>

on stderr and exiting with :data:`USER_ERROR_EXIT` (2, argparse's status for a bad
command line too). ``(rank R)`` names the process of a multi-rank job. Every other
exception keeps its traceback and Python's status 1 (a bug needs one).
``EMBRACE_TRACEBACK=1`` brings the traceback back for user errors too.

Three ways in, all printing through :func:`report`:

* :func:`command` decorates a console script's ``main``;
* :func:`guarded` wraps the ``main`` that fairseq's ``call_main`` runs, in this process or
  in the ranks ``torch.multiprocessing`` spawns (``--cpu --distributed-world-size N``): a
  rank prints its line and exits with the status, and the parent, seeing a rank end with
  it, exits with it too, silently;
* :func:`install` wraps ``sys.excepthook`` for what is raised outside those (fairseq's
  argument parsing, the plugin's import).
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
from types import TracebackType
from typing import Any, Callable, Optional, Type, TypeVar

from embrace_fairseq.core.errors import UserError

#: The exit status of every EmbRace command stopped by a user error (argparse uses it for
#: usage errors as well); 1 stays Python's status for a crash with a traceback.
USER_ERROR_EXIT = 2
PREFIX = "embrace: error: "

_Hook = Callable[[Type[BaseException], BaseException, Optional[TracebackType]], None]
_F = TypeVar("_F", bound=Callable[..., Any])


def _chain(exc: Optional[BaseException]):
    seen = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__


def user_error_of(exc: Optional[BaseException]) -> Optional[UserError]:
    """``exc`` or the first error in its cause/context chain that is a :class:`UserError`."""
    return next((e for e in _chain(exc) if isinstance(e, UserError)), None)


def _rank_reported(exc: BaseException) -> bool:
    """A spawned rank ended with :data:`USER_ERROR_EXIT` (torch.multiprocessing's
    ``ProcessExitedException``): it has printed its line already."""
    return any(type(e).__name__ == "ProcessExitedException" and getattr(e, "exit_code", None) == USER_ERROR_EXIT
               for e in _chain(exc))


def _rank() -> Optional[str]:
    rank = os.environ.get("RANK")
    if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1":
        return rank  # torchrun, the deepspeed launcher
    dist = sys.modules.get("torch.distributed")  # ranks fairseq spawned itself set no RANK
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return str(dist.get_rank())
    return None


def one_line(exc: UserError) -> str:
    """``embrace: error: [(rank R) ]Kind: message``, the message's lines joined by spaces."""
    rank = _rank()
    where = f"(rank {rank}) " if rank is not None else ""
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{PREFIX}{where}{type(exc).__name__}: {message}"


def report(exc: BaseException) -> Optional[int]:
    """For a user error: print its line, return :data:`USER_ERROR_EXIT`. For anything else
    (or under ``EMBRACE_TRACEBACK=1``): ``None``, and the caller lets the traceback out."""
    if os.environ.get("EMBRACE_TRACEBACK") == "1":
        return None
    found = user_error_of(exc)
    if found is not None:
        print(one_line(found), file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return USER_ERROR_EXIT if _rank_reported(exc) else None


class _Guarded:
    """``main`` that ends a user error with its line and :data:`USER_ERROR_EXIT`
    (``SystemExit``, which torch's spawn wrapper passes on as the rank's exit status).
    A class, not a closure: fairseq pickles ``main`` into each spawned rank."""

    def __init__(self, main: Callable[..., Any]) -> None:
        self.main = main
        functools.update_wrapper(self, main)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.main(*args, **kwargs)
        except Exception as exc:
            code = report(exc)
            if code is None:
                raise
            raise SystemExit(code) from None

    def __reduce__(self):
        return (_Guarded, (self.main,))


def guarded(main: Callable[..., Any]) -> Callable[..., Any]:
    """``main`` under :func:`report` (idempotent); picklable when ``main`` is."""
    return main if isinstance(main, _Guarded) else _Guarded(main)


def command(main: _F) -> _F:
    """Decorator for a console script's entry function: user errors end it with one line
    and :data:`USER_ERROR_EXIT`, and :func:`install` covers what it starts."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        install()
        return _Guarded(main)(*args, **kwargs)

    return run  # type: ignore[return-value]


def _exit(code: int) -> None:
    # The interpreter's status after sys.excepthook is always 1. Finish what a normal exit
    # does (the atexit handlers: multiprocessing's children, torch's and DeepSpeed's
    # clean-up; the streams), then leave with the status of a user error.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hook(previous: _Hook) -> _Hook:
    def excepthook(kind, exc, tb):
        code = report(exc)
        if code is None:
            return previous(kind, exc, tb)
        _exit(code)

    excepthook.embrace_one_line = True  # type: ignore[attr-defined]
    return excepthook


def install() -> None:
    """Wrap ``sys.excepthook`` once (idempotent)."""
    if not getattr(sys.excepthook, "embrace_one_line", False):
        sys.excepthook = _hook(sys.excepthook)
