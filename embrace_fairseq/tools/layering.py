"""The package's layering rule, checked from the source: imports point down only.

Layers, lowest first (a module may import from its own layer and those below)::

    core  <-  optim  <-  schedule  <-  guards  <-  planner  <-  fairseq_adapter, deepspeed_adapter
          <-  perf, recipes, data_prep, tools  <-  embrace_fairseq/__init__.py (public API)

``planner`` (the per-table plan and its cost model) sits below the adapters, which
build what it chooses, and below ``perf``, whose simulator uses its cost arithmetic.

Every ``import`` and ``from ... import`` counts, also those inside functions (a lazy
import is still a dependency). Relative imports are resolved; ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing
``a.b.c`` runs ``a/__init__`` too, but that is not counted as an edge: the package
``__init__`` files only describe or re-export.

``python -m embrace_fairseq.tools.layering`` prints the modules by layer and any
violation or cycle, exit status 1 when there is one; ``--tree`` prints one line per
module (its path and the first line of its docstring).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

PACKAGE = "embrace_fairseq"

#: First component under the package -> layer rank. The package ``__init__`` is the API.
LAYERS: Dict[str, int] = {
    "core": 0,
    "optim": 1,
    "schedule": 2,
    "guards": 3,
    "planner": 4,
    "fairseq_adapter": 5,
    "deepspeed_adapter": 5,
    "perf": 6,
    "recipes": 6,
    "data_prep": 6,
    "tools": 6,
}
API_RANK = 7

#: Compiled modules inside the package (no source to read; they import nothing of it).
EXTENSIONS = {"embrace_fairseq._native"}


@dataclass(frozen=True)
class Violation:
    """``importer`` (a file) imports ``imported`` from a higher layer."""

    importer: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line}: imports {self.imported} ({self.why})"


def modules(root: Path) -> Dict[str, Path]:
    """Dotted name -> file of every module of the package under ``root`` (the checkout)."""
    out: Dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> Tuple[str, int]:
    """(layer name, rank) of a dotted module name inside the package."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api", API_RANK
    name = parts[1]
    if name not in LAYERS:
        raise KeyError(f"{module}: {name!r} is in no layer; add it to LAYERS in {__name__}")
    return name, LAYERS[name]


def _imports(path: Path, module: str, is_package: bool, known: Set[str]) -> Iterable[Tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield node.lineno, _known_prefix(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in EXTENSIONS:
                    continue
                yield node.lineno, sub if sub in known else _known_prefix(target, known)


def _known_prefix(name: str, known: Set[str]) -> str:
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else name


def import_graph(root: Path) -> Dict[str, List[Tuple[int, str]]]:
    """Module -> [(line, imported module)] for imports inside the package."""
    mods = modules(root)
    known = set(mods)
    graph: Dict[str, List[Tuple[int, str]]] = {}
    for name, path in mods.items():
        edges = [(ln, m) for ln, m in _imports(path, name, path.name == "__init__.py", known) if m in known and m != name]
        graph[name] = edges
    return graph


def violations(root: Path) -> List[Violation]:
    """Imports from a higher layer, in file order."""
    mods = modules(root)
    out: List[Violation] = []
    for name, edges in import_graph(root).items():
        lname, rank = layer_of(name)
        for line, target in edges:
            tname, trank = layer_of(target)
            if trank > rank:
                out.append(Violation(str(mods[name].relative_to(root)), line, target,
                                     f"layer {lname} ({rank}) may not import layer {tname} ({trank})"))
    return out


def cycles(root: Path) -> List[List[str]]:
    """Import cycles (strongly connected components of two or more modules, or a
    module importing itself), each as the files involved."""
    graph = {m: sorted({t for _, t in e}) for m, e in import_graph(root).items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    mods = modules(root)
    return [[str(mods[m].relative_to(root)) for m in comp] for comp in found]


def report(root: Path) -> Tuple[str, bool]:
    """A listing of the modules by layer, then the problems; (text, ok)."""
    by_layer: Dict[str, List[str]] = {}
    for name in modules(root):
        by_layer.setdefault(layer_of(name)[0], []).append(name)
    lines = []
    for lname in sorted(by_layer, key=lambda n: (LAYERS.get(n, API_RANK), n)):
        lines.append(f"{lname}: " + ", ".join(by_layer[lname]))
    bad = [str(v) for v in violations(root)] + ["import cycle: " + " -> ".join(c) for c in cycles(root)]
    lines += bad or ["no upward import, no cycle"]
    return "\n".join(lines), not bad


def module_tree(root: Path) -> str:
    """One line per module, by layer: its path and the first line of its docstring."""
    lines = []
    mods = modules(root)
    for name in sorted(mods, key=lambda n: (layer_of(n)[1], n)):
        path = mods[name]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.strip().splitlines()[0] if doc.strip() else ""
        lines.append(f"{str(path.relative_to(root)):52s} {first}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(argv or [])
    tree = "--tree" in args
    args = [a for a in args if a != "--tree"]
    root = Path(args[0]) if args else Path(__file__).resolve().parents[2]
    if tree:
        print(module_tree(root))
        return 0
    text, ok = report(root)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
