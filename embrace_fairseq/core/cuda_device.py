"""Which CUDA device a rank's collectives use, set before the first one.

NCCL stages what it sends on ``torch.cuda.current_device()`` (object collectives, CPU
tensors of an NCCL-only group, barriers). A model built before the launcher's engine
sets the device (``deepspeed_adapter.initialize`` builds nothing, but the caller's model,
whose sharded tables run collectives as they are built, comes first) would put every
local rank on ``cuda:0``: NCCL then fails with a duplicate-GPU error or hangs.

Before its first collective each rank therefore (:func:`ensure_device`):

* sets the current device from ``LOCAL_RANK`` when nothing set it yet
  (:func:`choose_device`: the device a process group is bound to wins, a device other
  than the default ``cuda:0`` is the caller's choice and stays);
* publishes its GPU's identity in the default group's store (no communicator needed,
  whichever backend the group has) and stops with :class:`SharedGpuError` naming the
  ranks when two of them drive one GPU (:func:`refuse_shared_gpus`).

Nothing happens on a machine without CUDA.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from embrace_fairseq.core.errors import UserError

_STORE_PREFIX = "embrace/cuda_device/"


class SharedGpuError(UserError):
    """Two ranks of the job drive the same GPU."""


def choose_device(current: int, count: int, local_rank: Optional[int], bound: Optional[int] = None) -> Optional[int]:
    """The CUDA device index a rank should make current, or None to leave it. Pure.

    ``current``: ``torch.cuda.current_device()``; ``count``: the visible devices;
    ``local_rank``: the launcher's ``LOCAL_RANK`` (None when unset); ``bound``: the
    device the default process group was bound to (``init_process_group(device_id=)``).

    >>> choose_device(0, 8, 3)      # nothing set it: the launcher's local rank
    3
    >>> choose_device(5, 8, 3) is None  # the caller chose a device: it stays
    True
    >>> choose_device(0, 1, 3) is None  # one visible device per rank (CUDA_VISIBLE_DEVICES)
    True
    """
    if count <= 0:
        return None
    if bound is not None:
        return None if bound == current else bound
    if local_rank is None or current != 0:
        return None
    if local_rank < count:
        return None if local_rank == current else local_rank
    if count == 1:
        return None
    raise SharedGpuError(f"LOCAL_RANK={local_rank} but this process sees {count} GPUs: start at most one rank per GPU "
                         "on each node, or call torch.cuda.set_device before the model is built")


def refuse_shared_gpus(devices: Sequence[str]) -> None:
    """Stop with :class:`SharedGpuError` when two ranks name the same GPU. ``devices``:
    every rank's GPU identity, in rank order (:func:`gpu_identity`). Pure.

    >>> refuse_shared_gpus(["GPU-a", "GPU-b"])  # one GPU each: nothing to say
    >>> try:
    ...     refuse_shared_gpus(["GPU-a", "GPU-b", "GPU-a"])
    ... except SharedGpuError as exc:
    ...     print(str(exc).split(":")[0])
    ranks 0 and 2 both drive GPU-a
    """
    first: Dict[str, int] = {}
    clashes: List[str] = []
    for rank, device in enumerate(devices):
        if device in first:
            clashes.append(f"ranks {first[device]} and {rank} both drive {device}")
        else:
            first[device] = rank
    if clashes:
        raise SharedGpuError(
            "; ".join(clashes) + ": NCCL needs one GPU per rank (set CUDA_VISIBLE_DEVICES or call "
            "torch.cuda.set_device(LOCAL_RANK) before building the model, or start fewer ranks per node)")


def gpu_identity(index: int) -> str:
    """A name of CUDA device ``index`` that is the same for every process driving it: its
    UUID, else host and PCI bus id."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    bus = getattr(props, "pci_bus_id", index)
    return f"{socket.gethostname()}:{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}"


def exchange_identities(identity: str, store: Any, rank: int, world: int, prefix: str = _STORE_PREFIX) -> List[str]:
    """Every rank's ``identity``, through ``store`` (a :class:`torch.distributed.Store`):
    each rank writes its own key and reads the others'. Every rank calls it once."""
    store.set(f"{prefix}{rank}", identity)
    keys = [f"{prefix}{r}" for r in range(world)]
    store.wait(keys)
    return [store.get(k).decode() for k in keys]


_SET: Dict[int, int] = {}  # id of the default group -> the device made current
_CHECKED: Dict[int, bool] = {}  # id of the default group -> the ranks' GPUs compared
_LOCK = threading.Lock()


def _local_rank() -> Optional[int]:
    value = os.environ.get("LOCAL_RANK", "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def ensure_device(check: bool = True) -> Optional[int]:
    """The current CUDA device (None without CUDA), set from ``LOCAL_RANK`` when nothing
    set it (once per process group; local). ``check``: also compare it with the other
    ranks' GPUs, once per process group: a collective (every rank passes here before its
    first collective), so only the collectives themselves ask for it; a question such as
    "which backend runs this tensor" sets the device without waiting for the peers."""
    if not torch.cuda.is_available():
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return torch.cuda.current_device()
    key = id(dist.group.WORLD)
    if key in _CHECKED or (key in _SET and not check):
        return torch.cuda.current_device()
    with _LOCK:
        if key not in _SET:
            bound = getattr(dist.group.WORLD, "bound_device_id", None)
            choice = choose_device(torch.cuda.current_device(), torch.cuda.device_count(), _local_rank(),
                                   bound.index if bound is not None else None)
            if choice is not None:
                torch.cuda.set_device(choice)
            _SET[key] = torch.cuda.current_device()
        if check and key not in _CHECKED:
            refuse_shared_gpus(exchange_identities(gpu_identity(_SET[key]), dist.distributed_c10d._get_default_store(),
                                                   dist.get_rank(), dist.get_world_size()))
            _CHECKED[key] = True
    return torch.cuda.current_device()
