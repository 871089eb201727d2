"""Every collective of the package goes through embrace_fairseq/core/collectives.py.

Scans the source (AST) for calls of a torch.distributed collective, or of the group
constructor, anywhere else. The exceptions, each with its reason, are in ``EXEMPT``.
"""
import ast
from pathlib import Path
from typing import List, Set

ROOT = Path(__file__).resolve().parents[2] / "embrace_fairseq"

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list",
    "new_group", "new_subgroups",  # communicators are created (and warmed up) there too
}

EXEMPT = {
    # the one module allowed to call them
    "core/collectives.py",
    # benchmarks (another owner): the stock baselines they measure call torch.distributed
    # themselves, as the frameworks they stand for do
    "perf/",
    # starts the local ranks (init_process_group only; listed in case it ever synchronises)
    "tools/local_ranks.py",
}


def _dist_aliases(tree: ast.AST) -> tuple:
    """(names bound to torch.distributed, names bound to torch, collective names imported bare)."""
    dist_names: Set[str] = set()
    torch_names: Set[str] = set()
    bare: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    dist_names.add(a.asname)
                elif a.name in ("torch", "torch.distributed"):
                    torch_names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    dist_names.add(a.asname or "distributed")
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    bare.add(a.asname or a.name)
    return dist_names, torch_names, bare


def _is_dist(expr: ast.AST, dist_names: Set[str], torch_names: Set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in dist_names
    return (isinstance(expr, ast.Attribute) and expr.attr == "distributed"
            and isinstance(expr.value, ast.Name) and expr.value.id in torch_names)


def direct_collectives(source: str, filename: str = "<src>") -> List[str]:
    """``file:line: name`` of every direct torch.distributed collective call in ``source``."""
    tree = ast.parse(source, filename)
    dist_names, torch_names, bare = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_dist(f.value, dist_names, torch_names):
            found.append(f"{filename}:{node.lineno}: {f.attr}")
        elif isinstance(f, ast.Name) and f.id in bare:
            found.append(f"{filename}:{node.lineno}: {f.id}")
    return found


def _exempt(rel: str) -> bool:
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in EXEMPT)


def test_no_collective_outside_the_collectives_module():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not _exempt(rel):
            offenders += direct_collectives(path.read_text(), rel)
    assert not offenders, "call these through embrace_fairseq.core.collectives:\n" + "\n".join(offenders)


def test_the_check_sees_every_spelling():
    src = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_to_all_single as a2a, barrier\n"
        "dist.all_reduce(x)\ntorch.distributed.all_gather(p, x)\nd2.broadcast(x, 0)\na2a(o, i)\nbarrier()\n"
        "dist.new_group([0])\ndist.get_rank()\nother.all_reduce(x)\n"
    )
    found = direct_collectives(src)
    assert sorted(f.split(": ")[1] for f in found) == sorted(
        ["all_reduce", "all_gather", "broadcast", "a2a", "barrier", "new_group"])
    assert not any("get_rank" in f or ":12:" in f for f in found)  # not collectives / not torch


def test_exemptions_exist():
    for e in EXEMPT:
        assert (ROOT / e).exists(), f"stale exemption {e}"
