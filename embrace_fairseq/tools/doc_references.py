"""Every reference in the README and docs/ resolves: paths, modules, console scripts, flags.

``python -m embrace_fairseq.tools.doc_references [--root DIR]`` prints one line per broken
reference (``page:line: kind 'text': why``) and exits 1 if there is any; it also lists the
folders under ``results/`` that no page cites (a results folder nobody cites does not
belong in the tree) and those ``results/README.md`` does not map to a claim.

What counts as a reference, in a page's text (code spans, code blocks and links alike):

* a path whose first part is a top-level entry of the repository (``scripts/test.sh``,
  ``results/bench/quick``) or a subpackage of ``embrace_fairseq`` (``core/input_dist.py``,
  read under ``embrace_fairseq/``); a markdown link's target, relative to its page. Paths
  with placeholders (``<N>``, ``{a,b}``, ``$VAR``) are skipped; ``*`` is a glob that must
  match something; a path the repository ignores (.gitignore) is a command's output;
* ``python -m MODULE``: the module must be importable (found, not run);
* a console script ``embrace-*`` or ``fairseq-*``: an entry point of an installed package;
* a flag ``--name`` in code: some parser knows it. The parsers are read as text, not run:
  every ``"--name"`` literal in this repository's Python and shell files and in the
  installed sources of the tools the pages run (fairseq, fairseq_cli, DeepSpeed's
  launcher, torchrun, pytest, pip, setuptools), and every field of fairseq's dataclass configurations
  (``max_tokens`` is ``--max-tokens``).
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "embrace_fairseq"

_CODE_BLOCK = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.*-]*)")
_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_SCRIPT = re.compile(r"(?<![\w./-])((?:embrace|fairseq)-[a-z][a-z-]*[a-z])(?![\w.-])")
# after a comma a flag is passed through to another program (``-Wl,--exclude-libs,ALL``)
_FLAG = re.compile(r"(?<![\w,-])(--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*)(?![\w*-])")
_FIELD = re.compile(r"^\s+(\w+)\s*:[^=\n]*=\s*field\(", re.M)
#: make_dataclass's field tuples: ("embrace_plan", Optional[str], field(...))
_FIELD_TUPLE = re.compile(r"""\(\s*["'](\w+)["'],\s*[^,()]+(?:\([^()]*\))?[^,()]*,\s*field\(""")
_LITERAL_FLAG = re.compile(r"""["'](--[a-z][a-z0-9_-]*)["'=\s]""")
#: distutils' option tables: ('inplace', 'i', "help") is --inplace
_OPTION_TUPLE = re.compile(r"""\(\s*['"]([a-z][a-z0-9-]*)=?['"],\s*(?:['"]\w['"]|None)\s*,""")
_PLACEHOLDER = re.compile(r"[<>{}$]|\.\.\.")
#: distributions, not scripts, that share the scripts' prefixes
_DISTRIBUTIONS = {"embrace-fairseq", "fairseq-fixed"}
#: the results index: each folder of results/, the claim it supports and the page that makes it
INDEX = "README.md"


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    kind: str
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.kind} {self.text!r}: {self.why}"


def pages(root: Path = ROOT) -> List[Path]:
    """The pages a reader follows: the README and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _code(text: str) -> Iterator[tuple]:
    """(position, code) of every code block and code span."""
    for m in _CODE_BLOCK.finditer(text):
        yield m.start(1), m.group(1)
    outside = _CODE_BLOCK.sub(lambda m: " " * len(m.group(0)), text)
    for m in _CODE_SPAN.finditer(outside):
        yield m.start(1), m.group(1)


def _top_level(root: Path) -> Set[str]:
    names = {p.name for p in root.iterdir() if not p.name.startswith(".")} | {".ci"}
    return names - {"README.md"}


def _subpackages(root: Path) -> Set[str]:
    return {p.name for p in (root / PACKAGE).iterdir() if (p / "__init__.py").exists()}


def _resolve(token: str, page: Path, root: Path, top: Set[str], subs: Set[str],
             link: bool) -> Optional[List[Path]]:
    """Where ``token`` points (candidates), or None when it is not a reference of ours."""
    token = token.split("#", 1)[0].rstrip(".,:;")
    if not token or "://" in token or token.startswith(("mailto:", "/", "~")) or _PLACEHOLDER.search(token):
        return None
    first = token.split("/", 1)[0]
    if link:
        return [(page.parent / token)]
    if first in top:
        return [root / token]
    if first in subs:
        return [root / PACKAGE / token]
    return None


def _ignored(candidate: Path, root: Path) -> bool:
    """Paths the repository ignores are what commands write (``results/gpu_check/``)."""
    try:
        rel = candidate.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    done = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "--no-index", str(rel)],
                          capture_output=True)
    return done.returncode == 0


def _exists(candidate: Path) -> bool:
    """A file or folder; a glob that matches; a file named without its extension
    (``--out results/x/summary`` writes ``summary.json`` and ``summary.md``); a module
    named without ``.py``, or one of its attributes (``core/trace.hidden_share``)."""
    text = str(candidate).rstrip("/")
    if "*" in text:
        return bool(glob.glob(text))
    if candidate.exists() or glob.glob(glob.escape(text) + ".*"):
        return True
    module = candidate.with_name(candidate.name.split(".", 1)[0])  # the name only: a folder may hold dots
    return module.with_suffix(".py").exists() or (module / "__init__.py").exists()


def known_flags(root: Path = ROOT, extra_sources: Sequence[Path] = ()) -> Set[str]:
    """Every flag some parser of what the pages run declares (read from source text)."""
    flags: Set[str] = set()
    sources: List[Path] = []
    for pattern in ("**/*.py", "**/*.sh"):
        sources += [p for p in root.glob(pattern) if ".venv" not in p.parts and "tests" not in p.parts[:1]]
    for module in ("fairseq", "fairseq_cli", "deepspeed.launcher", "_pytest", "pip._internal.cli",
                   "setuptools.command", "setuptools._distutils.command"):
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec and spec.submodule_search_locations:
            base = Path(next(iter(spec.submodule_search_locations)))
            sub = base.joinpath(*module.split(".")[1:])
            sources += list(sub.rglob("*.py"))
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec and torch_spec.origin:
        sources.append(Path(torch_spec.origin).parent / "distributed" / "run.py")
    sources += list(extra_sources)
    for path in sources:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        flags.update(_LITERAL_FLAG.findall(text))
        flags.update("--" + name for name in _OPTION_TUPLE.findall(text))
        if "fairseq" in path.parts or "dataclass" in text:
            flags.update("--" + name.replace("_", "-") for name in _FIELD.findall(text))
            flags.update("--" + name.replace("_", "-") for name in _FIELD_TUPLE.findall(text))
    return flags


def console_scripts() -> Set[str]:
    names = {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}
    setup = (ROOT / "setup.py")
    if setup.exists():  # the package's own scripts, installed or not
        names.update(re.findall(r'"([\w-]+)\s*=\s*embrace_fairseq', setup.read_text()))
    return names


def check_page(page: Path, root: Path = ROOT, *, flags: Optional[Set[str]] = None,
               scripts: Optional[Set[str]] = None) -> List[Problem]:
    """The broken references of one page."""
    text = page.read_text()
    name = str(page.relative_to(root)) if page.is_relative_to(root) else str(page)
    top, subs = _top_level(root), _subpackages(root)
    flags = known_flags(root) if flags is None else flags
    scripts = console_scripts() if scripts is None else scripts
    out: List[Problem] = []
    seen = set()

    def report(pos: int, kind: str, token: str, why: str) -> None:
        key = (kind, token)
        if key not in seen:
            seen.add(key)
            out.append(Problem(name, _line_of(text, pos), kind, token, why))

    for m in _LINK.finditer(text):
        cands = _resolve(m.group(1), page, root, top, subs, link=True)
        if cands and not any(_exists(c) for c in cands):
            report(m.start(1), "link", m.group(1), "no such file")
    for pos, code in _code(text):
        for m in _PATH.finditer(code):
            if code[m.end():m.end() + 1] in ("{", "<", "$"):
                continue  # a placeholder follows: results/x.{json,md}, wmt14_$SIZE
            cands = _resolve(m.group(1), page, root, top, subs, link=False)
            if cands and not any(_exists(c) or _ignored(c, root) for c in cands):
                report(pos + m.start(1), "path", m.group(1), "no such file or folder")
        for m in _MODULE.finditer(code):
            module = m.group(1).rstrip(".")
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                report(pos + m.start(1), "module", module, "not importable")
        for m in _SCRIPT.finditer(code):
            if m.group(1) not in scripts and m.group(1) not in _DISTRIBUTIONS:
                report(pos + m.start(1), "script", m.group(1), "no such console script")
        for m in _FLAG.finditer(code):
            if m.group(1) not in flags:
                report(pos + m.start(1), "flag", m.group(1), "no parser declares it")
    return out


def _names(folder: str, corpus: str) -> bool:
    """Does ``corpus`` name ``results/a/b``: whole, as ``a/b``, or as `b` in a code span?"""
    return folder in corpus or folder.split("/", 1)[1] in corpus or f"`{folder.rsplit('/', 1)[1]}`" in corpus


def uncited_results(root: Path = ROOT, texts: Optional[Iterable[str]] = None) -> List[str]:
    """Folders under results/ (two levels) that no page names, directly or through a
    results file a page names (a pooled table cites the runs it pools)."""
    corpus = "\n".join([p.read_text() for p in pages(root)] if texts is None else texts)
    results = root / "results"
    # the index names every folder: it is not a citation of them
    cited_files = [f for f in sorted(results.rglob("*.md"))
                   if str(f.relative_to(root)) in corpus and f != results / INDEX]
    corpus += "\n".join(f.read_text() for f in cited_files)
    return [str(f.relative_to(root)) for f in _results_folders(root) if not _names(str(f.relative_to(root)), corpus)]


def _results_folders(root: Path) -> List[Path]:
    results = root / "results"
    return sorted(p for p in results.glob("*") if p.is_dir()) + sorted(p for p in results.glob("*/*") if p.is_dir())


def index_problems(root: Path = ROOT) -> List[str]:
    """``results/README.md`` maps every results folder (two levels) to its claim and page, and
    names no path that is gone. A tree without the index has nothing to check."""
    index = root / "results" / INDEX
    if not index.exists():
        return []
    text = index.read_text()
    named = {m.strip() for m in _CODE_SPAN.findall(text) if m.startswith("results/")}
    def indexed(folder: str) -> bool:  # itself, or what it holds (results/bench holds its runs)
        return any(n == folder or n.startswith(folder + "/") for n in named)

    out = [f"{f.relative_to(root)}: not in results/{INDEX}" for f in _results_folders(root)
           if not indexed(str(f.relative_to(root)))]
    out += [f"results/{INDEX}: {n}: no such file or folder" for n in sorted(named) if not _exists(root / n)]
    return out


def check(root: Path = ROOT) -> List[str]:
    """Every problem of every page, every uncited results folder and every gap of the results
    index, as lines."""
    flags, scripts = known_flags(root), console_scripts()
    lines = [str(p) for page in pages(root) for p in check_page(page, root, flags=flags, scripts=scripts)]
    lines += [f"{r}: no page cites this results folder" for r in uncited_results(root)]
    return lines + index_problems(root)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    problems = check(args.root)
    for line in problems:
        print(line)
    print(f"{len(problems)} broken or uncited reference(s)" if problems else "every reference resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
