"""Every measured figure in README.md and docs/*.md comes from a results file the page cites.

``python -m embrace_fairseq.tools.doc_figures [--root DIR]`` prints one line per problem
(``page:line: why``) and exits 1 if there is any.

The convention a page follows:

* A paragraph that gives measured figures cites the results they come from as a path in a
  code span: a file (`results/main_job.warm.json`, `results/bench/full/summary.md`) or a
  folder (`results/bench/vp_w4`: every .json and .md under it); once a folder is cited
  in full, later code spans may name it by its last part (`vp2_w4`). A table's sources
  are those its rows cite plus those of the paragraph just above it. A heading that cites
  results gives them to every paragraph of its section that cites none.
* A sentence takes its figures from the sources it cites itself (a comparison names both
  runs), else from one of its paragraph's sources: figures of two runs do not share a
  sentence that does not name them. A table row takes them from any source of its table.
* A figure is a number with a unit or a ratio mark (``1.06x``, ``12.3 %``, ``0.75 s``,
  ``28.2 min``, ``4.27 MB``, ``2,267 updates``), an interval ``[1.02, 1.09]`` and the estimate before it, or
  the number after BLEU, chrF, perplexity or loss; both ends of a range ``1.39-1.64x``.
  It matches a number of the source rounded as the page shows it (0.682 in the file is
  0.68 on the page), in the source's unit or converted (seconds as minutes or
  milliseconds, fractions as per cent, bytes as MB).
* Code blocks, code spans and links are not prose: versions, flags, defaults and sizes
  of configurations written there are never figures. Sentences that cite no results are
  not checked, except for the named quantities of :data:`REGISTRY`.
* A named quantity (:data:`REGISTRY`: the main job's BLEU, the simulator's out-of-sample
  error, the count of fault scenarios, the full benchmark's wall time, ...) has one value
  across all pages, and every paragraph that gives it cites a source.
* The main-job table between the ``main-job-table`` markers is what
  ``python -m embrace_fairseq.recipes.results_table`` renders from the results files.
"""
from __future__ import annotations

import argparse
import bisect
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from embrace_fairseq.recipes.results_table import render
from embrace_fairseq.tools.doc_references import ROOT, pages

_CODE_BLOCK = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\([^)\s]+\)")
_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
#: a number and its unit; a range (1.39-1.64x) gives its unit to both ends
_WITH_UNIT = re.compile(
    rf"(?<![\w.])[-+]?({_NUM})(?:\s*(?:-|to)\s*({_NUM}))?(x|\s?%|\s(?:s|ms|min|minutes|MB|updates)\b)(?![\w/])")
_INTERVAL = re.compile(rf"(?:({_NUM})(x?)\s)?\[({_NUM}), ({_NUM})\]")
_AFTER_WORD = re.compile(rf"\b(?:BLEU|chrF|perplexity|loss)(?: of| score)? ({_NUM})(?!\w|\.\d)")
_TABLE_CELL_NUM = re.compile(r"(?<![\w.\-/])(\d+\.\d+)(?![\w.])")
_FILE_NUM = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(*`])")
#: how a source's number may appear on a page, by the page's unit
_SCALES = {"": (1.0,), "x": (1.0,), "%": (1.0, 100.0), "s": (1.0, 1e-3), "ms": (1.0, 1e3),
           "min": (1.0, 1 / 60), "minutes": (1.0, 1 / 60), "MB": (1.0, 1e-6), "updates": (1.0,)}
MARKER_BEGIN = "<!-- main-job-table:begin"
MARKER_END = "<!-- main-job-table:end -->"


@dataclass(frozen=True)
class Quantity:
    """A measured quantity pages give; ``pattern``'s first matching group is its value.
    ``one_value``: every page gives the same value (False for a quantity of many runs,
    which only has to be cited wherever it is given)."""
    name: str
    pattern: str
    one_value: bool = True


#: The quantities more than one page states. A new one: its name and how pages phrase it.
REGISTRY = [
    Quantity("the simulator's out-of-sample mean absolute error",
             r"(?:mean absolute error of|within|error is|runs with a mean absolute error of) (\d+\.\d) %"
             r"|(\d+\.\d) % mean absolute error|mean abs error (\d+\.\d) % over"),
    Quantity("the number of fault scenarios", r"(?:all|of) (\d+) (?:fault )?scenarios"),
    Quantity("the full benchmark's wall time",
             r"bench_full\.sh.{0,300}?((?:about )?\d+(?:-\d+)?(?: \+ \d+)*) min"),
    Quantity("the main job's BLEU, warm", r"warm[^.]*?BLEU (\d+\.\d+)"),
    Quantity("the main job's BLEU, from nothing", r"from nothing[^.]*?BLEU (\d+\.\d+)"),
    Quantity("the soak's RSS growth", r"RSS growth (\d+\.\d+) %"),
    Quantity("a BLEU score", r"\bBLEU (?:of )?(\d+\.\d+)|(\d+\.\d+) BLEU\b", one_value=False),
    Quantity("a perplexity", r"perplexity (?:of )?(\d+\.\d+)", one_value=False),
    Quantity("the native dedup_bucket speed-up", r"dedup_bucket[^.]*?(\d+\.\d+)x faster"),
]


#: where a page states a registry quantity: (value, line, page, cited)
Seen = Tuple[str, int, str, bool]


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.why}"


@dataclass
class Block:
    """A paragraph or a table (with the paragraph above it as its caption)."""
    start: int          # line number of its first line
    lines: List[str]
    table: bool
    caption_sources: Tuple[str, ...] = ()


def _blank_code(text: str) -> str:
    """Code blocks replaced by blank lines, so line numbers stay."""
    return _CODE_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _drop_marker_block(text: str) -> str:
    if MARKER_BEGIN not in text:
        return text
    head, rest = text.split(MARKER_BEGIN, 1)
    block, tail = rest.split(MARKER_END, 1)
    return head + "\n" * (block.count("\n")) + tail


def _blocks(text: str) -> List[Block]:
    """Paragraphs, list items, tables and headings (one line each), in page order."""
    blocks: List[Block] = []
    current: List[str] = []
    start = 1

    def close() -> None:
        if current:
            blocks.append(Block(start, list(current), current[0].lstrip().startswith("|")))
            current.clear()

    for i, line in enumerate(text.split("\n"), start=1):
        is_row = line.lstrip().startswith("|")
        new_item = bool(re.match(r"\s*(?:[*-]|\d+\.) ", line)) or line.startswith("#")
        if not line.strip() or new_item or (current and is_row != current[0].lstrip().startswith("|")):
            close()
        if line.strip():
            if not current:
                start = i
            current.append(line)
            if line.startswith("#"):
                close()
    close()
    return blocks


class Sources:
    """What a page's code spans name under ``results/`` (or a ``.json`` beside the docs),
    and the numbers each holds."""

    def __init__(self, root: Path):
        self.root = root

    def resolve(self, token: str, known: Dict[str, str]) -> Optional[str]:
        token = token.strip().rstrip("/.,;:")
        if "{" in token or "*" in token or "<" in token:
            return None
        if token.startswith("results/") or (token.endswith(".json") and "/" in token):
            path = self.root / token
            if path.exists() or path.with_suffix(".md").exists():
                return token if path.exists() else token + ".md"
            return None
        return known.get(token)

    @lru_cache(maxsize=None)
    def streams(self, source: str) -> Tuple[Tuple[float, ...], ...]:
        """The numbers of each file of ``source``, in file order (signs dropped)."""
        path = self.root / source
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".md")) if path.is_dir() else [path]
        out = []
        for f in files:
            values = []
            for tok in _FILE_NUM.findall(f.read_text(errors="replace")):
                try:
                    values.append(abs(float(tok.replace(",", ""))))
                except ValueError:
                    pass
            out.append(tuple(values))
        return tuple(out)

    @lru_cache(maxsize=None)
    def index(self, source: str) -> Tuple[Tuple[float, int, int], ...]:
        """(value, file, position) of every number of ``source``, sorted by value."""
        return tuple(sorted((v, f, i) for f, values in enumerate(self.streams(source)) for i, v in enumerate(values)))

    def holds(self, source: str, figure: str, unit: str) -> bool:
        """Does ``source`` hold ``figure`` (as printed, in ``unit``), rounded as printed?"""
        return self.holds_run(source, [(figure, unit)])

    def holds_run(self, source: str, run: Sequence[Tuple[str, str]]) -> bool:
        """Does ``source`` hold the figures of ``run`` one after another (an estimate and
        its interval are printed together, and stored together)?"""
        index = self.index(source)
        keys = [v for v, _, _ in index]
        figure, unit = run[0]
        for scale in _SCALES.get(unit.strip(), (1.0,)):
            lo, hi = _bounds(figure, scale)
            for _, f, i in index[bisect.bisect_left(keys, lo):bisect.bisect_right(keys, hi)]:
                stream = self.streams(source)[f]
                if all(i + k < len(stream) and _bounds(fig, 1.0)[0] <= stream[i + k] <= _bounds(fig, 1.0)[1]
                       for k, (fig, _) in enumerate(run[1:], start=1)):
                    return True
        return False


def _bounds(figure: str, scale: float) -> Tuple[float, float]:
    """The source values that print as ``figure`` at its decimals, in the page's unit."""
    value = abs(float(figure.replace(",", "")))
    decimals = len(figure.split(".", 1)[1]) if "." in figure else 0
    half = 0.5 * 10 ** -decimals + 1e-9
    return (value - half) / scale, (value + half) / scale


def figures(sentence: str, table: bool = False) -> Iterator[Tuple[Tuple[str, str], ...]]:
    """Every measured figure in a sentence of prose (code spans and links already
    blanked), as runs of (figure, unit): an estimate and its interval form one run, which
    the source must hold in that order; any other figure is a run of one."""
    taken: List[Tuple[int, int]] = []

    def free(m: "re.Match") -> bool:
        return not any(a < m.end() and m.start() < b for a, b in taken)

    for m in _INTERVAL.finditer(sentence):
        taken.append(m.span())
        yield ((m.group(1), m.group(2)),) * bool(m.group(1)) + ((m.group(3), ""), (m.group(4), ""))
    for m in _WITH_UNIT.finditer(sentence):
        if free(m):
            taken.append(m.span())
            unit = m.group(3).strip()
            yield ((m.group(1), unit),)
            if m.group(2):
                yield ((m.group(2), unit),)
    for m in _AFTER_WORD.finditer(sentence):
        if free(m):
            taken.append(m.span())
            yield ((m.group(1), ""),)
    if table:
        for m in _TABLE_CELL_NUM.finditer(sentence):
            if free(m):
                yield ((m.group(1), ""),)


def _show(run: Sequence[Tuple[str, str]]) -> str:
    """``1.06x [1.02, 1.09]``, ``28.2 min``: a run as the page prints it."""
    shown = [f + (u if u in ("", "x", "%") else " " + u) for f, u in run]
    return shown[0] if len(shown) == 1 else f"{' '.join(shown[:-2])} [{shown[-2]}, {shown[-1]}]".lstrip()


def _quantities(text: str) -> Iterator[Tuple[str, Quantity]]:
    """(value, quantity) of every registry quantity ``text`` states."""
    text = " ".join(text.split())
    for q in REGISTRY:
        for m in re.finditer(q.pattern, text, re.S):
            yield next(g for g in m.groups() if g), q


def _sentences(block: Block) -> Iterator[Tuple[int, str]]:
    if block.table:
        for i, line in enumerate(block.lines):
            if not re.fullmatch(r"\s*\|[\s|:-]*\|?\s*", line):
                yield block.start + i, line
        return
    text = "\n".join(block.lines)
    pos = 0
    for part in _SENTENCE_END.split(text):
        at = text.find(part, pos)
        pos = at + len(part)
        yield block.start + text.count("\n", 0, at), part


def check_page(page: Path, root: Path = ROOT,
               sources: Optional[Sources] = None) -> Tuple[List[Problem], Dict[str, List[Seen]]]:
    """The figures of ``page`` its sources do not hold, and every registry quantity it
    gives: {name: [(value, line, page, cited)]}."""
    sources = sources or Sources(root)
    name = str(page.relative_to(root)) if page.is_relative_to(root) else page.name
    text = _drop_marker_block(_blank_code(page.read_text()))
    known: Dict[str, str] = {}
    problems: List[Problem] = []
    quantities: Dict[str, List[Seen]] = {}
    previous: Tuple[str, ...] = ()
    section: Tuple[str, ...] = ()  # what the heading above cites
    for block in _blocks(text):
        spans = [m.group(1) for line in block.lines for m in _CODE_SPAN.finditer(line)]
        cited = []
        for token in spans:
            src = sources.resolve(token, known)
            if src:
                cited.append(src)
                if (root / src).is_dir():
                    known.setdefault(Path(src).name, src)
        if block.lines[0].startswith("#"):
            section = tuple(cited)
            previous = ()
            continue
        block_sources = tuple(dict.fromkeys(cited + (list(previous) if block.table else [])))
        block_sources = block_sources or section
        for line_no, sentence in _sentences(block):
            own = [s for s in (sources.resolve(t, known) for t in _CODE_SPAN.findall(sentence)) if s]
            prose = _LINK.sub(" ", _CODE_SPAN.sub(" ", sentence))
            for value, q in _quantities(_LINK.sub(" ", sentence)):
                quantities.setdefault(q.name, []).append((value, line_no, name, bool(block_sources)))
            if not block_sources:
                continue
            found = list(figures(prose, block.table))
            if not found:
                continue
            # a sentence that cites its runs may compare them; one that cites none takes
            # its figures from one of its paragraph's sources; a table's columns may come
            # from the several runs its header or caption names
            candidates = own or list(block_sources)
            groups = [candidates] if own or block.table else [[s] for s in block_sources]
            if not any(all(any(sources.holds_run(s, run) for s in g) for run in found) for g in groups):
                missing = sorted({_show(run) for run in found if not any(sources.holds_run(s, run) for s in candidates)})
                where = ", ".join(candidates)
                why = (f"{', '.join(missing)} not in {where}" if missing else
                       f"figures of several sources in one sentence ({where}): one sentence per run")
                problems.append(Problem(name, line_no, why))
        previous = tuple(cited) if not block.table else ()
    # commands' comments state quantities too ("# about 75 min"): one value with the prose
    raw = page.read_text()
    for m in _CODE_BLOCK.finditer(raw):
        first = raw.count("\n", 0, m.start()) + 1
        for i, line in enumerate(m.group(0).split("\n")):
            for value, q in _quantities(line):
                quantities.setdefault(q.name, []).append((value, first + i, name, True))
    return problems, quantities


def _registry_problems(quantities: Dict[str, List[Seen]]) -> List[str]:
    out = []
    one_value = {q.name for q in REGISTRY if q.one_value}
    for q, seen in sorted(quantities.items()):
        values = sorted({v for v, *_ in seen})
        if len(values) > 1 and q in one_value:
            where = "; ".join(f"{page}:{line} {v}" for v, line, page, _ in seen)
            out.append(f"{q}: {len(values)} values across the pages ({where})")
        for v, line, page, cited in seen:
            if not cited:
                out.append(f"{page}:{line}: {q} ({v}) given without a cited results file")
    return out


def _table_problems(root: Path) -> List[str]:
    """The main-job block of each page is the rendering of the results files."""
    out = []
    for page in pages(root):
        text = page.read_text()
        if MARKER_BEGIN in text:
            block = text.split(MARKER_BEGIN, 1)[1].split("-->", 1)[1].split(MARKER_END, 1)[0]
            if block.strip() != render(root / "results").strip():
                out.append(f"{page.relative_to(root)}: the main-job table differs from the results files "
                           "(python -m embrace_fairseq.recipes.results_table --write PAGE)")
    return out


def check(root: Path = ROOT) -> List[str]:
    sources = Sources(root)
    lines: List[str] = []
    quantities: Dict[str, List[Seen]] = {}
    for page in pages(root):
        problems, q = check_page(page, root, sources)
        lines += [str(p) for p in problems]
        for k, v in q.items():
            quantities.setdefault(k, []).extend(v)
    return lines + _registry_problems(quantities) + _table_problems(root)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    problems = check(args.root)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s)" if problems else "every figure comes from the results file its page cites")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
