"""The launcher's guard against running the machine out of memory.

A workload on more ranks than the machine's memory holds does not fail by itself: once
memory runs out, the kernel's OOM killer ends one process of its choosing (a rank, the
launcher, or anything else on the machine) and the ranks left wait in their next collective.
XLM-R's stock ranks, for one, hold the logits of 1,229 masked positions over 250k rows and
their gradients (about 5.7 GB each), so 4 of them outgrow 23 GB during the warm-up. The
launcher therefore watches the machine's available memory while the ranks run, stops every
rank while a reserve is still free, and says what each rank held:

>>> below_reserve(1.0e9, reserve_gb=1.5), below_reserve(1.0e9, reserve_gb=0.5), below_reserve(1.0e9, 0)
(True, False, False)
>>> print(out_of_memory_message("xlmr", 4, 1.0e9, 24.6e9, [5.7e9, 5.6e9, 5.7e9, 5.5e9], 1.5))  # doctest: +NORMALIZE_WHITESPACE
xlmr on 4 ranks: stopped every rank, the machine's available memory fell to 1.0 of 24.6 GB
(reserve 1.5 GB; ranks held 5.7, 5.6, 5.7, 5.5 GB, 22.5 GB in all): this workload needs more memory
at this rank count than the machine has (fewer ranks, or --memory-reserve-gb 0 to let the kernel decide)
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import psutil

#: memory left free before the ranks are stopped, by default (a step of XLM-R's stock rank
#: allocates its 1.2 GB logits at once; the launcher polls every tenth of a second)
DEFAULT_RESERVE_GB = 1.5


def machine_memory() -> Tuple[int, int]:
    """(available, total) bytes of this machine now (the kernel's ``MemAvailable``)."""
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def below_reserve(available: float, reserve_gb: float) -> bool:
    """Whether the ranks must stop: less than ``reserve_gb`` free (0 or less: never)."""
    return reserve_gb > 0 and available < reserve_gb * 1e9


def resident_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (a rank may run under ``ip netns
    exec``); 0 for a process that is gone."""
    try:
        proc = psutil.Process(pid)
        tree = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in tree:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def out_of_memory_message(model: str, world: int, available: float, total: float, rank_bytes: Sequence[float],
                          reserve_gb: float) -> str:
    """The launcher's error: where memory stood, what each rank held, what to do."""
    held: List[str] = [f"{b / 1e9:.1f}" for b in rank_bytes]
    return (f"{model} on {world} ranks: stopped every rank, the machine's available memory fell to "
            f"{available / 1e9:.1f} of {total / 1e9:.1f} GB (reserve {reserve_gb:g} GB; ranks held "
            f"{', '.join(held)} GB, {sum(rank_bytes) / 1e9:.1f} GB in all): this workload needs more memory at this "
            "rank count than the machine has (fewer ranks, or --memory-reserve-gb 0 to let the kernel decide)")
