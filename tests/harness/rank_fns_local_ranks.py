"""Per-rank bodies of the tests of :mod:`embrace_fairseq.tools.local_ranks`: what a rank sees
of its caller (environment, working folder, standard error)."""
from __future__ import annotations

import os
import sys
from typing import Optional, Tuple


def environment_and_folder(rank: int, world: int, name: str) -> Tuple[Optional[str], str]:
    return os.environ.get(name), os.getcwd()


def say_on_stderr(rank: int, world: int, text: str) -> int:
    print(f"{text} {rank}", file=sys.stderr, flush=True)
    return rank
