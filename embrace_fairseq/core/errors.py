"""The mark of a user's mistake: an error whose message names the problem and its fix.

EmbRace's own refusals (a bad ``"embrace"`` key, a flag combination it cannot run, a
checkpoint table that does not match the dictionary, ranks started differently) derive
from :class:`UserError` as well as from the builtin error they always were, so callers
that catch ``ValueError`` or ``RuntimeError`` still do. Every command prints such an error
as one line, ``embrace: error: [(rank R) ]Kind: message``, and exits with status 2 instead
of a traceback (:mod:`embrace_fairseq.guards.one_line_errors`).
"""
from __future__ import annotations


class UserError(Exception):
    """An error the user fixes by changing a command, a config or a file: its message says how."""
