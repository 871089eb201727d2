"""The strategy registry: every strategy complete, one name each, lookups everywhere go through it."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embrace_fairseq.core import ledger as K
from embrace_fairseq.perf import strategies as S
from embrace_fairseq.perf.bounds import min_bytes_per_step
from embrace_fairseq.perf.simulator import Network, Prediction, Profile, predict

REPO = Path(__file__).resolve().parents[2]
NAMES = ("fairseq_legacy_ddp", "fairseq_c10d", "deepspeed", "deepspeed_zero1", "deepspeed_zero2", "sparse_allgather",
         "sparse_allgather_overlap",
         "embrace_noschedule", "embrace_fifo", "embrace_schedule", "embrace_auto", "embrace_zero1", "embrace_nogate",
         "embrace_gate", "embrace_node",
         "embrace_two_level", "embrace_next_forward", "embrace_next_forward_gate", "embrace_next_forward_whole",
         "embrace_relaxed", "embrace_contiguous", "embrace_eager_output_grad", "embrace_output_gather",
         "embrace_output_vocab_parallel", "compute_floor")
FLOOR = "compute_floor"  # no communication: no bytes, step = compute
# reduce-scatter the gradients, all-gather the parameters (EmbRace on ZeRO-1: the dense ones)
ZERO = ("deepspeed_zero1", "deepspeed_zero2", "embrace_zero1")


def _tiny_profile(tied=None):
    return Profile(name="tiny", vocab=100, dim=4, dense_layers=[("a", 50), ("b", 70)], tokens_per_rank=40,
                   forward_s=0.01, backward_s=0.02, optimizer_s=0.005, unique_ids_per_rank={2: [20.0, 22.0]},
                   tied_output=tied)


def test_the_strategies_in_order():
    assert S.STRATEGIES == S.strategy_names() == NAMES
    assert S.sharded_strategies() == ["embrace_noschedule", "embrace_fifo", "embrace_schedule", "embrace_zero1",
                                      "embrace_nogate", "embrace_gate",
                                      "embrace_node", "embrace_two_level", "embrace_next_forward",
                                      "embrace_next_forward_gate", "embrace_next_forward_whole", "embrace_relaxed",
                                      "embrace_contiguous", "embrace_eager_output_grad", "embrace_output_gather",
                                      "embrace_output_vocab_parallel"]
    assert S.SPEEDUP_SUBJECT in NAMES and S.REFERENCE in NAMES
    # the default plan is neither a baseline nor a fixed EmbRace configuration
    assert [n for n in NAMES if S.get_strategy(n).planned] == ["embrace_auto"]
    assert [n for n in NAMES if S.is_baseline(n)] == list(NAMES[:7])


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_has_all_parts(name):
    spec = S.get_strategy(name)
    assert spec.name == name and spec.label and spec.short and len(spec.description) > 20
    # volume: bytes by kind for a step on 2 ranks
    ids = [torch.tensor([0, 1, 60]), torch.tensor([55, 3])]
    vol = min_bytes_per_step(name, world_size=2, vocab=100, dim=4, dense_numel=120, ids_per_rank=ids)
    # the dense gradients all-reduced (2 ranks: the payload), or reduce-scattered under ZeRO
    assert vol.get(K.DENSE_GRAD, 0.0) == (0.0 if name == FLOOR else 120 * 4 / (2 if name in ZERO else 1))
    assert vol["total"] == pytest.approx(sum(v for k, v in vol.items() if k != "total"))
    # simulator cost: a prediction for this strategy (its cost function is importable)
    pred = spec.cost.resolve()  # an ImportError or AttributeError here is a broken registration
    assert callable(pred)
    p = predict(_tiny_profile(), name, 2, Network(1.0))
    assert isinstance(p, Prediction) and p.strategy == name and p.compute_s > 0
    assert p.step_s > p.compute_s if name != FLOOR else p.step_s == p.compute_s and p.comm_s == 0.0
    # benchmark builder: importable (building needs ranks, a model and data)
    assert callable(spec.build.resolve())
    assert spec.build.resolve().__module__ == "embrace_fairseq.perf.bench.builders"


def test_labels_and_short_names_are_distinct():
    specs = [S.get_strategy(n) for n in NAMES]
    assert len({s.label for s in specs}) == len({s.short for s in specs}) == len(NAMES)


def test_unknown_names_raise_naming_the_known_ones():
    for call in (lambda: S.get_strategy("horovod"),
                 lambda: S.canonical_strategy("horovod"),
                 lambda: predict(_tiny_profile(), "horovod", 2, Network(1.0)),
                 lambda: min_bytes_per_step("horovod", world_size=1, vocab=5, dim=2, dense_numel=0,
                                            ids_per_rank=[torch.tensor([1])])):
        with pytest.raises(ValueError, match="unknown strategy 'horovod'; expected one of fairseq_legacy_ddp, "
                                             "fairseq_c10d, deepspeed, deepspeed_zero1, deepspeed_zero2, sparse_allgather, "
                                                 "sparse_allgather_overlap, embrace_noschedule, "
                                             "embrace_fifo, "
                                             "embrace_schedule"):
            call()


def test_aliases_resolve_to_one_strategy():
    assert S.canonical_strategy("e") == "embrace_schedule"
    assert S.canonical_strategy("  Legacy-DDP ") == "fairseq_legacy_ddp"
    assert S.canonical_strategy("ZeRO0") == "deepspeed"
    assert S.canonical_strategy("ZeRO1") == "deepspeed_zero1" and S.canonical_strategy("b2") == "deepspeed_zero2"
    assert S.canonical_strategy("embrace-no-schedule") == "embrace_noschedule"
    for alias, name in S.aliases().items():
        assert name in NAMES and alias not in NAMES
        assert S.get_strategy(alias) is S.get_strategy(name)
    # an alias predicts and bounds exactly what its strategy does
    net = Network(1.0, latency_s=1e-4)
    assert predict(_tiny_profile(), "d", 2, net) == predict(_tiny_profile(), "embrace_noschedule", 2, net)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test do not leak into the package's registry."""
    monkeypatch.setattr(S, "_REGISTRY", dict(S._REGISTRY))
    monkeypatch.setattr(S, "_ALIASES", dict(S._ALIASES))


def _register(name, aliases=()):
    return S.register_strategy(name, label=name, short=name, description="a test strategy",
                               volume=lambda step: {}, cost=lambda ctx: None, build=lambda *a, **k: None,
                               aliases=aliases)


def test_registering_a_name_twice_raises(scratch_registry):
    spec = _register("horovod_allreduce", aliases=("hvd",))
    assert S.get_strategy("HVD") is spec and "horovod_allreduce" in S.strategy_names()
    with pytest.raises(ValueError, match="'horovod_allreduce' is registered already"):
        _register("horovod_allreduce")
    with pytest.raises(ValueError, match="'deepspeed' is registered already"):
        _register("deepspeed")
    with pytest.raises(ValueError, match="'hvd' is registered already"):
        _register("hvd")  # a name taken by an alias
    with pytest.raises(ValueError, match="'e' is registered already"):
        _register("another", aliases=("E",))  # an alias taken by an alias
    with pytest.raises(ValueError, match="lower case"):
        _register("Horovod")


def test_package_registry_is_untouched_by_the_scratch_registrations():
    assert S.strategy_names() == NAMES and "hvd" not in S.aliases()


def _module_level_imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in tree.body:  # module level only: imports inside functions run when called
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module


def test_registry_modules_import_nothing_heavy_at_module_level():
    heavy = ("torch", "numpy", "fairseq", "deepspeed", "matplotlib", "embrace_fairseq.perf.simulator",
             "embrace_fairseq.perf.bench")
    for rel in ("perf/strategies.py", "planner/volume.py", "core/ring_volume.py", "core/ledger.py"):
        found = [m for m in _module_level_imports(REPO / "embrace_fairseq" / rel) if m.startswith(heavy)]
        assert found == [], (rel, found)


@pytest.mark.slow
def test_importing_the_registry_imports_no_simulator_builder_or_framework():
    code = ("import sys, embrace_fairseq.perf.strategies, embrace_fairseq.perf.bench.__main__; "
            "heavy = [m for m in ('embrace_fairseq.perf.simulator', 'embrace_fairseq.perf.bench.builders', "
            "'fairseq', 'deepspeed', 'matplotlib') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _name_comparisons(path: Path):
    """Comparisons of a string literal naming a strategy (``x == "deepspeed"``,
    ``x in ("fairseq_c10d", ...)``, ``x.startswith("embrace")``) in one source file."""
    tree = ast.parse(path.read_text())
    prefixes = tuple(NAMES) + ("embrace", "fairseq_", "sparse")
    for node in ast.walk(tree):
        strings = []
        if isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                if isinstance(c, ast.Constant):
                    strings.append(c.value)
                elif isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                    strings += [e.value for e in c.elts if isinstance(e, ast.Constant)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args
              and isinstance(node.args[0], ast.Constant)):
            strings.append(node.args[0].value)
        for s in strings:
            # (aliases such as "c10d" are also fairseq's --ddp-backend values: not checked)
            if isinstance(s, str) and (s in NAMES or s in prefixes):
                yield f"{path.relative_to(REPO)}:{node.lineno}: {s!r}"


def test_no_branching_on_strategy_names_in_the_package():
    found = [hit for p in sorted((REPO / "embrace_fairseq").rglob("*.py")) for hit in _name_comparisons(p)]
    assert found == []


def test_embrace_on_zero1_is_the_exchange_plus_zero_on_the_dense_layers():
    """(e-z1): the exchange's bytes of (e), the dense gradients reduce-scattered and the
    dense parameters all-gathered (the table's rows stay where they are stepped)."""
    ids = [torch.tensor([0, 1, 60]), torch.tensor([55, 3])]
    kw = dict(world_size=2, vocab=100, dim=4, dense_numel=120, ids_per_rank=ids)
    e, ez, z = (min_bytes_per_step(n, **kw) for n in ("embrace_schedule", "embrace_zero1", "deepspeed_zero1"))
    for k in (K.COUNTS, K.IDS, K.ROWS, K.GRAD_ROWS):
        assert ez[k] == e[k]
    assert ez[K.DENSE_GRAD] == 120 * 4 / 2 and ez[K.PARAM_GATHER] == 120 * 4 / 2
    assert K.TABLE_GRAD not in ez and z[K.PARAM_GATHER] == (100 * 4 + 120) * 4 / 2
    # simulator: the same exchange, ZeRO-1's dense part without the table
    prof = _tiny_profile()
    pe, pz = predict(prof, "embrace_noschedule", 2, Network(1.0)), predict(prof, "embrace_zero1", 2, Network(1.0))
    assert pz.detail["exchange_fwd_s"] == pe.detail["exchange_fwd_s"] > 0
    assert pz.detail["allgather_s"] > 0 and pz.compute_s < pe.compute_s  # 1/N of the optimizer step
