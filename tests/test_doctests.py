"""The examples in docstrings run: a module whose example no longer holds fails here."""
import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import embrace_fairseq


def _modules_with_examples():
    for info in pkgutil.walk_packages(embrace_fairseq.__path__, "embrace_fairseq."):
        if info.ispkg:
            continue
        spec = importlib.util.find_spec(info.name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                if ">>>" in f.read():
                    yield info.name


MODULES = sorted(_modules_with_examples())


def test_examples_are_found():
    assert "embrace_fairseq.perf.bench.stats" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
