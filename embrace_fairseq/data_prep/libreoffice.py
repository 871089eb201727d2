"""German-English segment pairs from the LibreOffice help, aligned by (page, paragraph id).

Layout found in Debian's ``libreoffice-help-de`` / ``libreoffice-help-en-us`` (7.4, bookworm):
``usr/share/libreoffice/help/<lang>/text/<module>/<...>/<page>.html``, with ``<lang>`` ``de``
and ``en-US``; the relative page paths and paragraph ids are the same in both languages.
Pages may also be ``.xhp`` (the XML the HTML is generated from); both go through the same
extractor. Alignment needs no sentence aligner: a paragraph in the German page is the
translation of the English paragraph with the same id. An id that occurs several times in a
page is paired by occurrence rank, and only when both languages have it equally often.

Held-out sets are whole top-level help modules (``text/<module>/``), so no page of the
valid or test set is seen in training.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

from embrace_fairseq.data_prep.errors import LayoutError
from embrace_fairseq.data_prep.help_html import extract_paragraphs

HELP_PACKAGES: Dict[str, str] = {"de": "libreoffice-help-de", "en": "libreoffice-help-en-us"}
HELP_LANG_DIRS: Dict[str, str] = {"de": "de", "en": "en-US"}
HELP_SUBDIR = "usr/share/libreoffice/help"
PAGE_SUFFIXES = (".html", ".xhp")


@dataclass(frozen=True)
class Segment:
    """One aligned pair; ``page`` is the path below ``text/`` (or ``ui/<catalog>`` for UI strings)."""

    page: str
    pid: str
    de: str
    en: str

    @property
    def module(self) -> str:
        return self.page.split("/", 1)[0]


def help_text_root(extract_dir: Path, lang: str) -> Path:
    """The ``text/`` folder of an extracted help package; LayoutError names what is missing."""
    lang_dir = HELP_LANG_DIRS[lang]
    root = Path(extract_dir) / HELP_SUBDIR / lang_dir / "text"
    if not root.is_dir():
        raise LayoutError(
            f"{HELP_PACKAGES[lang]}: expected help pages under {root} "
            f"(usr/share/libreoffice/help/{lang_dir}/text/<module>/*.html); not found")
    if not list_pages(root):
        raise LayoutError(f"{HELP_PACKAGES[lang]}: no *.html or *.xhp pages under {root}")
    return root


def list_pages(root: Path) -> List[str]:
    """Relative POSIX paths of all help pages below ``root``, sorted for a stable order."""
    root = Path(root)
    pages = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(PAGE_SUFFIXES):
                pages.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(pages)


def _ranked(paragraphs: Iterable[Tuple[str, str]]) -> Dict[Tuple[str, int], str]:
    seen: Dict[str, int] = defaultdict(int)
    out: Dict[Tuple[str, int], str] = {}
    for pid, text in paragraphs:
        out[(pid, seen[pid])] = text
        seen[pid] += 1
    return out


def align_page(de_markup: str, en_markup: str) -> List[Tuple[str, str, str]]:
    """``[(id, de, en), ...]`` in English document order; ids repeated unequally are dropped."""
    de_pars = extract_paragraphs(de_markup)
    en_pars = extract_paragraphs(en_markup)
    de_count: Dict[str, int] = defaultdict(int)
    en_count: Dict[str, int] = defaultdict(int)
    for pid, _ in de_pars:
        de_count[pid] += 1
    for pid, _ in en_pars:
        en_count[pid] += 1
    de_ranked = _ranked(de_pars)
    out = []
    for (pid, rank), en_text in _ranked(en_pars).items():
        if de_count[pid] != en_count[pid]:
            continue
        out.append((pid, de_ranked[(pid, rank)], en_text))
    return out


def align_help(de_root: Path, en_root: Path) -> List[Segment]:
    """All aligned paragraphs of the pages present in both languages, in (page, document) order."""
    de_pages = set(list_pages(de_root))
    segments: List[Segment] = []
    for page in list_pages(en_root):
        if page not in de_pages:
            continue
        de_markup = (Path(de_root) / page).read_text(encoding="utf-8", errors="replace")
        en_markup = (Path(en_root) / page).read_text(encoding="utf-8", errors="replace")
        for pid, de, en in align_page(de_markup, en_markup):
            segments.append(Segment(page=page, pid=pid, de=de, en=en))
    return segments


def split_by_module(segments: Sequence[Segment], valid_modules: Sequence[str],
                    test_modules: Sequence[str]) -> Dict[str, List[Segment]]:
    """Put whole modules into valid/test and everything else into train (no page crosses)."""
    overlap = set(valid_modules) & set(test_modules)
    if overlap:
        raise ValueError(f"modules both in valid and test: {sorted(overlap)}")
    splits: Dict[str, List[Segment]] = {"train": [], "valid": [], "test": []}
    for seg in segments:
        if seg.module in test_modules:
            splits["test"].append(seg)
        elif seg.module in valid_modules:
            splits["valid"].append(seg)
        else:
            splits["train"].append(seg)
    return splits
