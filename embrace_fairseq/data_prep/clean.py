"""Filtering rules for parallel segments.

What is dropped and why:
- ``empty``: either side has no text (image-only paragraphs, empty bookmark paragraphs);
- ``untranslated``: source equals target (function names, numbers, code), nothing to learn;
- ``ratio``: the longer side is over ``ratio_min_chars`` characters and more than
  ``max_ratio`` times the shorter one: a paragraph whose translation was restructured;
- ``long``: more than ``max_words`` words on either side, too long for the small model;
- ``duplicate``: the same (de, en) pair seen before in the same split (first one kept).
Train pairs whose German or English side occurs in valid or test are removed too
(`drop_overlap`), so no held-out segment is trained on even when a page embeds text shared
across modules.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Set, Tuple, TypeVar

from embrace_fairseq.data_prep.libreoffice import Segment

T = TypeVar("T", bound=Segment)


@dataclass(frozen=True)
class CleanRules:
    """Thresholds of the filters; recorded in the manifest."""

    max_ratio: float = 3.0
    ratio_min_chars: int = 10
    max_words: int = 150


def reject_reason(de: str, en: str, rules: CleanRules = CleanRules()) -> Optional[str]:
    """Why a pair is dropped (``empty``, ``untranslated``, ``ratio``, ``long``) or None to keep."""
    if not de or not en:
        return "empty"
    if de == en:
        return "untranslated"
    short, longer = sorted((len(de), len(en)))
    if longer > rules.ratio_min_chars and longer > rules.max_ratio * short:
        return "ratio"
    if len(de.split()) > rules.max_words or len(en.split()) > rules.max_words:
        return "long"
    return None


def clean_segments(segments: Iterable[T], rules: CleanRules = CleanRules()) -> Tuple[List[T], Counter]:
    """Apply the rules and drop duplicate pairs (first kept); returns kept and drop counts."""
    kept: List[T] = []
    seen: Set[Tuple[str, str]] = set()
    dropped: Counter = Counter()
    for seg in segments:
        reason = reject_reason(seg.de, seg.en, rules)
        if reason is None and (seg.de, seg.en) in seen:
            reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        seen.add((seg.de, seg.en))
        kept.append(seg)
    return kept, dropped


def drop_overlap(train: Sequence[T], *heldout: Sequence[Segment]) -> Tuple[List[T], int]:
    """Remove train pairs whose German or English text occurs in any held-out split."""
    de_seen = {s.de for split in heldout for s in split}
    en_seen = {s.en for split in heldout for s in split}
    kept = [s for s in train if s.de not in de_seen and s.en not in en_seen]
    return kept, len(train) - len(kept)


def subsample(segments: Sequence[T], max_pairs: Optional[int]) -> List[T]:
    """A deterministic, content-keyed subset of ``max_pairs`` pairs, kept in original order.

    Ranking by a hash of the pair (not taking the first N) keeps the subset spread over all
    modules, and does not depend on the order segments arrive in.
    """
    if max_pairs is None or max_pairs >= len(segments):
        return list(segments)
    ranked = sorted(range(len(segments)), key=lambda i: hashlib.sha1(
        f"{segments[i].de}\t{segments[i].en}".encode("utf-8")).hexdigest())
    chosen = set(ranked[:max_pairs])
    return [s for i, s in enumerate(segments) if i in chosen]
