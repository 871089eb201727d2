"""The launcher's guard against running the machine out of memory.

A workload on more ranks than the machine's memory holds does not fail by itself: once
memory runs out, the kernel's OOM killer ends one process of its choosing (a rank, the
launcher, or anything else on the machine) and the ranks left wait in their next collective.
XLM-R's stock ranks, for one, hold the logits of 1,229 masked positions over 250k rows and
their gradients (about 5.7 GB each), so 4 of them outgrow 23 GB during the warm-up. The
launcher therefore watches the machine's available memory while the ranks run, stops every
rank while a reserve is still free, and says what each rank held:

>>> info = "MemTotal:       24000000 kB\\nMemFree:  100 kB\\nMemAvailable:    1000000 kB\\n"
>>> available, total = memory_of(info)
>>> available, total
(1024000000, 24576000000)
>>> below_reserve(available, reserve_gb=1.5), below_reserve(available, reserve_gb=0.5), below_reserve(available, 0)
(True, False, False)
>>> print(out_of_memory_message("xlmr", 4, available, total, [5.7e9, 5.6e9, 5.7e9, 5.5e9], 1.5))  # doctest: +NORMALIZE_WHITESPACE
xlmr on 4 ranks: stopped every rank, the machine's available memory fell to 1.0 of 24.6 GB
(reserve 1.5 GB; ranks held 5.7, 5.6, 5.7, 5.5 GB, 22.5 GB in all): this workload needs more memory
at this rank count than the machine has (fewer ranks, or --memory-reserve-gb 0 to let the kernel decide)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence, Tuple

#: memory left free before the ranks are stopped, by default (a step of XLM-R's stock rank
#: allocates its 1.2 GB logits at once; the launcher polls every tenth of a second)
DEFAULT_RESERVE_GB = 1.5


def memory_of(meminfo: str) -> Tuple[int, int]:
    """(available, total) bytes from the text of ``/proc/meminfo``."""
    fields = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            fields[key.strip()] = int(parts[0]) * 1024  # kB
    return fields["MemAvailable"], fields["MemTotal"]


def machine_memory() -> Tuple[int, int]:
    """(available, total) bytes of this machine now."""
    return memory_of(Path("/proc/meminfo").read_text())


def below_reserve(available: int, reserve_gb: float) -> bool:
    """Whether the ranks must stop: less than ``reserve_gb`` free (0 or less: never)."""
    return reserve_gb > 0 and available < reserve_gb * 1e9


def resident_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (a rank may run under ``ip netns
    exec``); 0 for a process that is gone."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def out_of_memory_message(model: str, world: int, available: int, total: int, rank_bytes: Sequence[float],
                          reserve_gb: float) -> str:
    """The launcher's error: where memory stood, what each rank held, what to do."""
    held: List[str] = [f"{b / 1e9:.1f}" for b in rank_bytes]
    return (f"{model} on {world} ranks: stopped every rank, the machine's available memory fell to "
            f"{available / 1e9:.1f} of {total / 1e9:.1f} GB (reserve {reserve_gb:g} GB; ranks held "
            f"{', '.join(held)} GB, {sum(rank_bytes) / 1e9:.1f} GB in all): this workload needs more memory at this "
            "rank count than the machine has (fewer ranks, or --memory-reserve-gb 0 to let the kernel decide)")
