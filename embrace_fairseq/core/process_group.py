"""Which ranks a sharded table spans (resolving ``process_group=None``), and a free
port for a local rendezvous."""
from __future__ import annotations

import socket
from typing import Optional, Tuple

import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def resolve_group(process_group: ProcessGroup = None) -> Tuple[ProcessGroup, int, int]:
    """Return ``(group, rank, world_size)``.

    ``None`` means the default group when torch.distributed is initialised, and a
    world of one (plain embedding, no collectives) when it is not.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialised")
        return None, 0, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def free_port() -> int:
    """A TCP port free on localhost right now (for a torchrun/env:// rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
