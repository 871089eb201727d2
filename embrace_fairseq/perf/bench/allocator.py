"""The ranks' CPU memory allocator: one that keeps freed memory, as GPU training does.

PyTorch on a GPU keeps freed blocks in its caching allocator, so after the first step a
training step takes no fresh memory from the driver. On the CPU, glibc hands blocks above
its mmap threshold back to the kernel when they are freed, and the next step faults them in
again page by page. On a virtual machine those faults cost more than the arithmetic of a
large-vocabulary step: a softmax over 250,002 rows for 1,229 masked positions, forward and
backward, took 3.3 to 3.8 s with glibc, 2.2 to 2.6 s of it in the kernel, and 1.0 s with
jemalloc keeping its pages (one rank, one thread). The stock paths allocate the most (full
logits, the whole table's gradient), so the faults slowed them more than EmbRace: an edge
no GPU gives. The benchmark's ranks therefore run with jemalloc and its freed pages kept
(``dirty_decay_ms:-1``) where the library is installed (Debian: ``libjemalloc2``); the
results file and the report say which allocator ran.

>>> env, what = allocator_env("glibc", {})
>>> env, what
({}, 'glibc malloc (freed large blocks go back to the kernel)')
"""
from __future__ import annotations

import glob
from typing import Dict, Mapping, Optional, Tuple

#: where distributions install jemalloc's shared library
JEMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2",
                  "/usr/local/lib/libjemalloc.so.2")
#: keep freed pages (no decay back to the kernel), as a caching allocator does
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
ALLOCATORS = ("auto", "jemalloc", "glibc")


def find_jemalloc() -> Optional[str]:
    for pattern in JEMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def allocator_env(choice: str, env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """The environment variables that give the ranks the allocator ``choice`` (``auto``:
    jemalloc where installed, else glibc), and a description for the results file.
    ``jemalloc`` not installed raises ``ValueError`` naming the package."""
    if choice not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {choice!r}")
    lib = None if choice == "glibc" else find_jemalloc()
    if lib is None:
        if choice == "jemalloc":
            raise ValueError("--allocator jemalloc: libjemalloc.so.2 not found (Debian/Ubuntu: apt-get install "
                             "libjemalloc2)")
        return {}, "glibc malloc (freed large blocks go back to the kernel)"
    preload = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "MALLOC_CONF": JEMALLOC_CONF}, f"jemalloc ({lib}, {JEMALLOC_CONF})"
