"""The ranks' allocator: jemalloc keeping its pages where installed, glibc otherwise, and a
clear error when jemalloc is asked for and missing."""
import pytest

from embrace_fairseq.perf.bench import allocator as A


def test_jemalloc_preloaded_with_its_pages_kept(tmp_path, monkeypatch):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    monkeypatch.setattr(A, "JEMALLOC_GLOBS", (str(tmp_path / "libjemalloc.so.*"),))
    env, what = A.allocator_env("auto", {"LD_PRELOAD": "/x/other.so"})
    assert env == {"LD_PRELOAD": f"{lib} /x/other.so", "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    assert what.startswith("jemalloc (") and str(lib) in what
    assert A.allocator_env("glibc", {})[0] == {}


def test_missing_jemalloc_falls_back_or_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(A, "JEMALLOC_GLOBS", (str(tmp_path / "none*.so"),))
    assert A.allocator_env("auto", {}) == ({}, "glibc malloc (freed large blocks go back to the kernel)")
    with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
        A.allocator_env("jemalloc", {})
    with pytest.raises(ValueError, match="allocator must be one of"):
        A.allocator_env("tcmalloc", {})
