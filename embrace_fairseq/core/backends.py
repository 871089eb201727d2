"""Which backend runs a collective, from the group's configuration as torch built it.

:func:`backend_for` is the one answer to "which backend runs a tensor on device ``d`` in
group ``g``": read from the group's backend *configuration*, the per-device table torch
really built (:func:`torch.distributed.get_backend_config`), never from the name it was
asked for. ``"cpu:gloo,cuda:nccl"`` runs CUDA tensors on NCCL and CPU tensors on gloo; a
bare ``init_process_group()`` (backend ``"undefined"``) builds only the accelerator's
default backend (NCCL on a CUDA machine, gloo without one).

Placement (:func:`placement`, a pure function of that table): a tensor on a device the
group has a backend for stays there (a CUDA tensor on its own device, NCCL included); a
tensor on a device it has none for (a few agreement integers, a digest, a validation
total on the CPU of an NCCL-only group) is staged to one it has (CUDA first: the current
device, which :func:`~embrace_fairseq.core.cuda_device.ensure_device` sets from
``LOCAL_RANK`` before the first collective) and the result copied back (by
:mod:`~embrace_fairseq.core.collectives`).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core.cuda_device import ensure_device

Group = Optional["dist.ProcessGroup"]

#: a configuration that names no device
_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
#: devices a single-name backend serves (``Backend.backend_capability``)
_CAPABILITY = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "ucc": ("cpu", "cuda"), "mpi": ("cpu", "cuda")}


# --------------------------------------------------------------------------- backends and placement
def backend_table(config: str, cuda_available: bool = False) -> Dict[str, str]:
    """Device type -> backend of a group's configuration string. Pure.

    ``config`` is what :func:`torch.distributed.get_backend_config` reports
    (``"cpu:gloo,cuda:nccl"``, ``"cpu:gloo"``, ``"cuda:nccl"``) or a bare backend name
    (``"nccl"``, ``"gloo"``, ``"undefined"``: resolved as torch resolves it, the
    accelerator's default backend only).

    >>> backend_table("cpu:gloo,cuda:nccl")
    {'cpu': 'gloo', 'cuda': 'nccl'}
    >>> backend_table("undefined", cuda_available=True)
    {'cuda': 'nccl'}
    """
    name = str(config).strip().lower()
    if ":" in name:
        table: Dict[str, str] = {}
        for pair in name.split(","):
            device, _, backend = pair.partition(":")
            if not backend:
                raise ValueError(f"backend configuration {config!r}: {pair!r} is not 'device:backend'")
            table[device.strip()] = backend.strip()
        return table
    if name == "undefined":
        accel = "cuda" if cuda_available else "cpu"
        return {accel: _DEFAULT_BACKEND[accel]}
    return {d: name for d in _CAPABILITY.get(name, ("cpu", "cuda"))}


def placement(backend: str, device: torch.device, cuda_index: Optional[int]) -> torch.device:
    """Where a tensor on ``device`` must be for a collective on a group whose backend
    configuration is ``backend`` (see :func:`backend_table`).

    ``cuda_index`` is the current CUDA device (None when there is none). Pure: the
    rule every collective here applies.

    * a device the group has a backend for: as given (a CUDA tensor stays on its own
      device under NCCL too: the current device may not be the one the tensor, and the
      rank, use);
    * another device: staged to one the group has a backend for (CUDA first, where
      there is a current CUDA device), e.g. a CPU tensor of an NCCL group;
    * an error where neither applies (NCCL without a CUDA device).
    """
    device = torch.device(device)
    return _resolve(backend_table(backend, cuda_index is not None), device, cuda_index)[1]


def _resolve(table: Mapping[str, str], device: torch.device, cuda_index: Optional[int]) -> Tuple[str, torch.device]:
    """(backend, device) of a tensor on ``device`` in a group with ``table``."""
    if device.type in table:
        backend = table[device.type]
        if backend != "nccl":
            return backend, device
        if device.index is not None:
            return backend, device
        if cuda_index is None:
            raise RuntimeError("an NCCL process group needs a CUDA device, and none is available "
                               "(use gloo on CPU machines, or call torch.cuda.set_device first)")
        return backend, torch.device("cuda", cuda_index)
    if "cuda" in table:
        if cuda_index is None:
            if table["cuda"] == "nccl":
                raise RuntimeError("an NCCL process group needs a CUDA device, and none is available "
                                   "(use gloo on CPU machines, or call torch.cuda.set_device first)")
        else:
            return table["cuda"], torch.device("cuda", cuda_index)
    if "cpu" in table:
        return table["cpu"], torch.device("cpu")
    raise RuntimeError(f"the process group has no backend for {device.type} tensors (its backends: {dict(table)}); "
                       "give it one, e.g. init_process_group('cpu:gloo,cuda:nccl')")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group_table(group: Group) -> Dict[str, str]:
    return backend_table(dist.get_backend_config(group), torch.cuda.is_available())


def _cuda_index() -> Optional[int]:
    """The current CUDA device (None without CUDA), set from ``LOCAL_RANK`` when nothing
    set it (:mod:`.cuda_device`; the collectives also compare it with the peers')."""
    return ensure_device(check=False)


def backend_for(group: Group = None, device: Any = "cpu") -> str:
    """The backend that runs a collective of ``group`` on a tensor on ``device`` (after
    staging, see :func:`placement`): ``"nccl"``, ``"gloo"``, ... The one place the
    package asks which backend a collective uses."""
    return _resolve(_group_table(group), torch.device(device), _cuda_index())[0]


def backend_name(group: Group = None) -> str:
    """The name the group's backend was asked for (``"gloo"``, ``"cpu:gloo,cuda:nccl"``,
    ``"undefined"``...): for messages only. Decisions use :func:`backend_for`."""
    return str(dist.get_backend(group)).lower()


def world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Group = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def device_for(group: Group = None, device: Any = "cpu") -> torch.device:
    """Where a tensor on ``device`` must be for a collective on ``group``."""
    return _resolve(_group_table(group), torch.device(device), _cuda_index())[1]


def single_thread_forced() -> bool:
    """``EMBRACE_SINGLE_THREAD_ISSUE=1``: the single-thread issue mode on any backend."""
    return os.environ.get("EMBRACE_SINGLE_THREAD_ISSUE", "").strip().lower() in ("1", "true", "yes", "on")


def issues_from_one_thread(group: Group = None, device: Any = "cuda") -> bool:
    """Whether collectives of ``group`` on tensors on ``device`` must be issued from one
    thread, in one order on every rank: NCCL kernels of different communicators may wait
    on each other on the device, so their relative order matters (gloo's groups progress
    independently). Also when ``EMBRACE_SINGLE_THREAD_ISSUE=1``."""
    return single_thread_forced() or backend_for(group, device) == "nccl"




def group_label(group: Group = None) -> str:
    """A stable name of ``group``, the same on every rank: torch's group name (a counter
    over the groups created, in creation order) and its ranks."""
    if not is_distributed():
        return "local"
    pg = group if group is not None else dist.group.WORLD
    try:
        ranks = dist.get_process_group_ranks(pg)
    except Exception:  # not a member
        ranks = []
    return f"{pg.group_name}:{','.join(str(r) for r in ranks)}"
