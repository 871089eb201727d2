"""The layering rule holds on the package, and the checker catches what it must."""
from __future__ import annotations

import shutil
from pathlib import Path

from embrace_fairseq.tools import layering

ROOT = Path(__file__).resolve().parents[2]


def test_package_imports_point_down_only_and_have_no_cycle():
    text, ok = layering.report(ROOT)
    assert ok, text


def test_every_module_is_in_a_layer():
    for name in layering.modules(ROOT):
        layering.layer_of(name)  # raises KeyError naming the module otherwise


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "embrace_fairseq", tmp_path / "embrace_fairseq",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_planted_upward_import_is_named(tmp_path):
    root = _copy(tmp_path)
    _plant(root / "embrace_fairseq/core/shard_plan.py", "from embrace_fairseq.perf import bounds  # planted")
    found = layering.violations(root)
    assert [v.importer for v in found] == ["embrace_fairseq/core/shard_plan.py"], found
    assert found[0].imported == "embrace_fairseq.perf.bounds"
    assert "layer core (0) may not import layer perf (6)" in str(found[0])


def test_planted_lazy_relative_upward_import_is_named(tmp_path):
    root = _copy(tmp_path)
    _plant(root / "embrace_fairseq/optim/grad_norm.py",
           "def _late():\n    from ..guards import watchdog  # planted, inside a function\n    return watchdog")
    found = layering.violations(root)
    assert [(v.importer, v.imported) for v in found] == [
        ("embrace_fairseq/optim/grad_norm.py", "embrace_fairseq.guards.watchdog")], found


def test_planted_cycle_is_named(tmp_path):
    root = _copy(tmp_path)
    # shard_plan <- ids is not an import today; planting both directions makes a cycle inside core
    _plant(root / "embrace_fairseq/core/shard_plan.py", "from embrace_fairseq.core import ids  # planted")
    _plant(root / "embrace_fairseq/core/ids.py", "from embrace_fairseq.core.shard_plan import ShardPlan  # planted")
    assert layering.violations(root) == []
    assert layering.cycles(root) == [["embrace_fairseq/core/ids.py", "embrace_fairseq/core/shard_plan.py"]]
    assert not layering.report(root)[1]
