"""Binarise sentencepiece-encoded text with ``fairseq-preprocess``.

The command is the one next to the running interpreter (the venv's), so the binaries are
written by the fairseq that will read them. ``--workers 1`` keeps the output independent of
how lines are split between workers. fairseq writes ``preprocess.log`` into the destination;
it holds timestamps, so it is removed to keep every output byte-reproducible (its content is
returned instead). The destination is built in a temporary folder and moved into place.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from embrace_fairseq.data_prep.errors import ToolError


def preprocess_command() -> List[str]:
    """``<bin dir of sys.executable>/fairseq-preprocess``, else ``python -m fairseq_cli.preprocess``."""
    exe = Path(sys.executable).parent / "fairseq-preprocess"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "fairseq_cli.preprocess"]


def run_preprocess(args: Sequence[str], destdir: Path) -> str:
    """Run fairseq-preprocess with ``args`` + ``--destdir``; returns its log text."""
    destdir = Path(destdir)
    tmp = destdir.with_name(destdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = preprocess_command() + list(args) + ["--destdir", str(tmp), "--workers", "1"]
    env = dict(os.environ, PYTHONHASHSEED="0")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except FileNotFoundError as exc:
        raise ToolError(f"fairseq-preprocess not found ({cmd[0]}); is fairseq installed in "
                        f"{sys.prefix}?") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise ToolError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: " + " | ".join(tail))
    log = tmp / "preprocess.log"
    text = log.read_text(encoding="utf-8") if log.exists() else proc.stderr
    if log.exists():
        log.unlink()
    shutil.rmtree(destdir, ignore_errors=True)
    os.replace(tmp, destdir)
    return text


def binarize_translation(spm_dir: Path, destdir: Path, src: str = "de", tgt: str = "en") -> str:
    """Joined-dictionary binarisation of ``spm_dir/{train,valid,test}.{src,tgt}``."""
    spm_dir = Path(spm_dir)
    args = ["--source-lang", src, "--target-lang", tgt,
            "--trainpref", str(spm_dir / "train"), "--validpref", str(spm_dir / "valid"),
            "--testpref", str(spm_dir / "test"), "--joined-dictionary"]
    return run_preprocess(args, destdir)


def binarize_lm(spm_dir: Path, destdir: Path, suffix: Optional[str] = ".txt") -> str:
    """Source-only binarisation of ``spm_dir/{train,valid,test}.txt`` (``--task language_modeling``)."""
    spm_dir = Path(spm_dir)
    args = ["--only-source",
            "--trainpref", str(spm_dir / f"train{suffix}"), "--validpref", str(spm_dir / f"valid{suffix}"),
            "--testpref", str(spm_dir / f"test{suffix}")]
    return run_preprocess(args, destdir)
