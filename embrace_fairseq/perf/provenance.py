"""Which tree a measurement was taken on: the commit and whether the tree had changes.

Every results file the performance tools write carries :func:`source_state`, so a figure
can be traced to the code that produced it (and one taken on a modified tree says so).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, Optional, Union

REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def source_state(root: Path = REPO_ROOT) -> Dict[str, Union[str, bool, None]]:
    """``{"commit": <sha or None>, "dirty": <tracked files changed?>}`` of the checkout at ``root``.

    ``commit`` is None outside a git checkout (an installed package); ``dirty`` is then None too.
    Untracked files do not make a tree dirty (data lands there), nor do changes under
    ``results/`` (a run rewrites the results files the repository carries); changes to
    other tracked files, staged or not, do. ``EMBRACE_COMMIT``, where set, is the commit
    (``dirty`` False): a copy of the tree sent to another machine to be measured may carry
    no ``.git``, or an older one, and the sender knows what it sent.
    """
    if os.environ.get("EMBRACE_COMMIT"):
        return {"commit": os.environ["EMBRACE_COMMIT"], "dirty": False}
    sha = _git(root, "rev-parse", "HEAD")
    if sha is None:
        return {"commit": None, "dirty": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return {"commit": sha.strip(), "dirty": None if status is None else bool(status.strip())}
