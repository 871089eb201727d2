"""Every collective the package issues, on the device its process group needs.

One module, in the style of Megatron's ``mappings.py``: small public functions, one per
collective; where a collective is part of autograd, a private ``autograd.Function``
with a public wrapper (:func:`gather_rows_from_group`). No other module of the package
calls a ``torch.distributed`` collective (``tests/core/test_collective_discipline.py``).

Backends and placement (:mod:`~embrace_fairseq.core.backends`, re-exported here):
:func:`backend_for` says which backend runs a tensor on a device in a group, from the
group's configuration as torch built it (``"cpu:gloo,cuda:nccl"``: NCCL for CUDA
tensors; a bare ``init_process_group()``: the accelerator's default only); a tensor on a
device the group has no backend for is staged to one it has and the result copied back.

Communicators are created eagerly: :func:`new_group` warms a new group up with a
one-element all-reduce, so no communicator is set up in the middle of a step (NCCL
creates them lazily at the first collective otherwise).

Every collective passes :func:`~embrace_fairseq.core.issue_log.issuing` right before it
is handed to torch: the issue fences and the ``EMBRACE_ISSUE_LOG`` log.

Asynchronous collectives return a :class:`~embrace_fairseq.core.pending.Pending`, given
every tensor the collective reads or writes (``keep``): it holds them until the caller
is ordered after the collective, on every backend.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from embrace_fairseq.core.backends import (  # noqa: F401  (re-exported: the package asks here)
    Group, _cuda_index, _group_table, _resolve, backend_for, backend_name, backend_table, device_for, group_label,
    is_distributed, issues_from_one_thread, placement, rank, single_thread_forced, world_size)
from embrace_fairseq.core.cuda_device import ensure_device
from embrace_fairseq.core.issue_log import (  # noqa: F401  (re-exported)
    add_issue_fence, fences_off, issuing, mark_host_vote, remove_issue_fence)
from embrace_fairseq.core.pending import (  # noqa: F401  (re-exported)
    Pending, _FutureWork, _now_us, event_us, record_event)

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def _placed(t: torch.Tensor, group: Group) -> Tuple[torch.Tensor, bool]:
    ensure_device()  # the first collective: the device set and compared with the peers' GPUs
    d = device_for(group, t.device)
    if t.device == d:
        return t, False
    return t.to(d), True


def _op(op: str) -> Any:
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


# --------------------------------------------------------------------------- groups
def new_group(ranks: Optional[Sequence[int]] = None, host_vote: bool = False) -> Group:
    """A new process group over ``ranks`` (all by default), created and warmed up now.
    Collective over the default group: every rank calls it in the same order.

    ``host_vote``: a gloo group for small host-side votes (CPU tensors), outside the
    device issue order of the other groups (and of the issue log)."""
    if not is_distributed():
        return None
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    ensure_device()
    if host_vote:
        group = dist.new_group(ranks=ranks, backend="gloo")
        mark_host_vote(group)
    else:
        group = dist.new_group(ranks=ranks)
    warm_up(group)
    return group


def warm_up(group: Group = None) -> None:
    """Create the communicator of ``group`` now (a one-element all-reduce). Collective."""
    if is_distributed() and (group is None or group != dist.GroupMember.NON_GROUP_MEMBER):
        all_reduce(torch.zeros(1), group=group)


# --------------------------------------------------------------------------- synchronous
def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group = None) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (``op``: sum, max, min, product). Returns it."""
    placed, moved = _placed(tensor, group)
    issuing("all_reduce", group, placed.numel())
    dist.all_reduce(placed, op=_op(op), group=group)
    if moved:
        tensor.copy_(placed)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group = None) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (equal shapes on every rank), on ``tensor``'s device."""
    placed, moved = _placed(tensor.contiguous(), group)
    parts = [torch.empty_like(placed) for _ in range(world_size(group))]
    issuing("all_gather", group, placed.numel())
    dist.all_gather(parts, placed, group=group)
    return [p.to(tensor.device) for p in parts] if moved else parts


def all_gather_object(obj: Any, group: Group = None) -> List[Any]:
    """Every rank's picklable ``obj`` (torch stages it on the group's device)."""
    out: List[Any] = [None] * world_size(group)
    ensure_device()  # torch stages the bytes on the current device: the rank's own
    issuing("all_gather_object", group, "var")
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int = 0, group: Group = None) -> Optional[List[Any]]:
    """Every rank's picklable ``obj`` on group rank ``dst``, in rank order; None on the
    other ranks, which receive nothing (their memory holds their own object only, at any
    world size). The writer of a checkpoint needs the others' state, nobody else does.

    Point to point, one sender at a time: ``dst`` holds one peer's bytes on the group's
    device at a time and unpickles them before the next arrive (``gather_object`` would
    stage the largest object times the world size there). Logged as one collective."""
    world, me = world_size(group), rank(group)
    ensure_device()  # torch stages the bytes on the current device: the rank's own
    issuing("gather_object", group, "var")
    if world == 1:
        return [obj]
    if me != dst:
        dist.send_object_list([obj], group=group, group_dst=dst)
        return None
    out: List[Any] = [None] * world
    out[me] = obj
    for src in range(world):
        if src != dst:
            box: List[Any] = [None]
            dist.recv_object_list(box, group=group, group_src=src)
            out[src] = box[0]
    return out


def _a2a_count(t: torch.Tensor, splits: Optional[List[int]]) -> Any:
    return t.numel() if splits is None else "var"


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Group = None) -> torch.Tensor:
    """AlltoAll of row blocks (uneven splits allowed) into ``output``. Returns it."""
    out_p, moved = _placed(output, group)
    in_p, _ = _placed(input.contiguous(), group)
    issuing("all_to_all", group, _a2a_count(in_p, input_split_sizes))
    dist.all_to_all_single(out_p, in_p, output_split_sizes, input_split_sizes, group=group)
    if moved:
        output.copy_(out_p)
    return output


def barrier(group: Group = None) -> None:
    """Every rank of ``group`` reaches this point (NCCL: on the current device)."""
    issuing("barrier", group, 0)
    table = _group_table(group)
    cuda = ensure_device()
    if "cpu" not in table and table.get("cuda") == "nccl" and cuda is not None:
        dist.barrier(group=group, device_ids=[cuda])
    else:
        dist.barrier(group=group)


def all_reduce_async(tensor: torch.Tensor, group: Group = None) -> Pending:
    """Sum ``tensor`` over ``group`` in place, asynchronously."""
    placed, moved = _placed(tensor, group)

    def finish() -> torch.Tensor:
        if moved:
            tensor.copy_(placed)
        return tensor

    def launch() -> Any:
        issuing("all_reduce", group, placed.numel())
        return dist.all_reduce(placed, group=group, async_op=True)

    return Pending(launch, placed.device, finish, keep=(placed, tensor), group=group)

class _ChainWorker:
    """One thread that runs chains of collectives (each a callable) in the order they
    were submitted: every rank submits the same chains in the same order, so the
    collectives inside pair up, whatever each rank's caller does meanwhile."""

    def __init__(self, name: str) -> None:
        import queue

        self._queue: Any = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, chain: Callable[[], Any]) -> _FutureWork:
        work = _FutureWork()
        self._queue.put((chain, work))
        return work

    def _run(self) -> None:
        while True:
            chain, work = self._queue.get()
            try:
                chain()
            except BaseException as exc:  # handed to whoever waits for the work
                work.future.set_exception(exc)
            else:
                work.future.set_result(None)


_CHAIN_WORKERS: dict = {}
_CHAIN_LOCK = threading.Lock()


def _chain_worker(key: Any) -> _ChainWorker:
    with _CHAIN_LOCK:
        if key not in _CHAIN_WORKERS:
            _CHAIN_WORKERS[key] = _ChainWorker("embrace-two-level")
        return _CHAIN_WORKERS[key]


def chunk_sizes(numel: int, parts: int) -> List[int]:
    """``numel`` elements in ``parts`` contiguous chunks differing by at most one."""
    base, extra = divmod(numel, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def all_reduce_two_level(tensor: torch.Tensor, node_group: Group, rail_group: Group) -> torch.Tensor:
    """Sum a contiguous ``tensor`` over the job in place, in two levels: a reduce-scatter
    inside the node (an AlltoAll of chunks), an all-reduce of this rank's chunk across
    the nodes (on its rail: the ranks with its local index), an all-gather inside the
    node. Each node's ranks send ``2 (M-1)/M`` of the tensor across nodes together,
    against ``2 (N-1)/N`` of it leaving each node in one ring over all ``N`` ranks.

    For backends whose all-reduce knows no nodes (gloo); NCCL builds its rings and trees
    from the topology itself."""
    flat = tensor.view(-1)
    parts, me = world_size(node_group), rank(node_group)
    sizes = chunk_sizes(flat.numel(), parts)
    mine = sizes[me]
    received = flat.new_empty(parts * mine)
    all_to_all_single(received, flat, [mine] * parts, sizes, node_group)
    chunk = received.view(parts, mine).sum(0)
    all_reduce(chunk, group=rail_group)
    all_to_all_single(flat, chunk.repeat(parts), sizes, [mine] * parts, node_group)
    return tensor


def all_reduce_two_level_async(tensor: torch.Tensor, node_group: Group, rail_group: Group) -> Pending:
    """:func:`all_reduce_two_level` as a :class:`Pending`. Its three steps run on a thread
    of their own, one per pair of groups, in the order they were issued: the caller
    returns at once, as from an asynchronous all-reduce (a caller that waited for them
    could deadlock against a peer that is busy with another group first), and chains
    issued from completion callbacks instead could pair differently on different ranks.
    Use the groups for nothing else."""
    worker = _chain_worker((id(node_group), id(rail_group)))
    return Pending(lambda: worker.submit(lambda: all_reduce_two_level(tensor, node_group, rail_group)),
                   tensor.device, lambda: tensor, keep=(tensor,))


def all_gather_async(tensor: torch.Tensor, group: Group = None) -> Pending:
    """Every rank's ``tensor`` (equal shapes); :meth:`Pending.wait` returns the list."""
    placed, moved = _placed(tensor.contiguous(), group)
    parts = [torch.empty_like(placed) for _ in range(world_size(group))]

    def finish() -> List[torch.Tensor]:
        return [p.to(tensor.device) for p in parts] if moved else parts

    def launch() -> Any:
        issuing("all_gather", group, placed.numel())
        return dist.all_gather(parts, placed, group=group, async_op=True)

    return Pending(launch, placed.device, finish, keep=(placed, *parts), group=group)


def all_to_all_single_async(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]],
                            input_split_sizes: Optional[List[int]], group: Group = None,
                            then: Optional[Callable[[torch.Tensor], Any]] = None) -> Pending:
    """:func:`all_to_all_single`, asynchronously; :meth:`Pending.wait` returns ``output``
    (or ``then(output)``, computed where the caller waits)."""
    out_p, moved = _placed(output, group)
    in_p, _ = _placed(input.contiguous(), group)

    def finish() -> Any:
        if moved:
            output.copy_(out_p)
        return output if then is None else then(output)

    def launch() -> Any:
        issuing("all_to_all", group, _a2a_count(in_p, input_split_sizes))
        return dist.all_to_all_single(out_p, in_p, output_split_sizes, input_split_sizes, group=group,
                                      async_op=True)

    return Pending(launch, out_p.device, finish, keep=(in_p, out_p), group=group)


# --------------------------------------------------------------------------- rows of a table
def all_gather_rows(shard: torch.Tensor, sizes: Sequence[int], group: Group = None) -> torch.Tensor:
    """The full table from every rank's rows (``sizes[r]`` rows on rank ``r``, uneven
    allowed: shards are padded to the largest, as gloo's all-gather needs)."""
    rows = max(sizes)
    padded = shard.new_zeros(rows, *shard.shape[1:])
    padded[: shard.shape[0]] = shard
    parts = all_gather(padded, group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def all_gather_uneven_rows(rows: torch.Tensor, sizes: Sequence[int], group: Group = None) -> torch.Tensor:
    """Every rank's rows (``sizes[r]`` on rank ``r``) on every rank, in rank order, with
    nothing padded on the wire: an AlltoAll that sends this rank's rows to each peer
    once, ``(N-1) sizes[rank]`` rows sent, where the padded all-gather of
    :func:`all_gather_rows` sends ``(N-1) max(sizes)``. For per-step token counts,
    which differ between ranks by much more than a table's shards do."""
    return gather_token_rows_async(rows, sizes, group).wait()


def gather_token_rows_async(rows: torch.Tensor, sizes: Sequence[int], group: Group = None) -> Pending:
    """Every rank's rows (``sizes[r]`` on rank ``r``), in rank order, asynchronously:
    :meth:`Pending.wait` returns the ``sum(sizes)`` rows. An all-gather when every rank
    has as many rows, else the unpadded AlltoAll of :func:`all_gather_uneven_rows`; the
    caller computes on its own rows meanwhile."""
    world = len(sizes)
    out = rows.new_empty(sum(sizes), *rows.shape[1:])
    if min(sizes) == max(sizes):
        placed, moved = _placed(rows.contiguous(), group)
        staged = out if not moved else out.to(placed.device)
        parts = list(staged.chunk(world)) if staged.shape[0] else [staged] * world

        def finish() -> torch.Tensor:
            if moved:
                out.copy_(staged)
            return out

        def launch() -> Any:
            issuing("all_gather", group, placed.numel())
            return dist.all_gather(parts, placed, group=group, async_op=True)

        return Pending(launch, placed.device, finish, keep=(placed, staged), group=group)
    return all_to_all_single_async(out, rows.repeat(world, *([1] * (rows.dim() - 1))), list(sizes),
                                   [rows.shape[0]] * world, group)


def reduce_scatter_rows(full: torch.Tensor, sizes: Sequence[int], group: Group = None,
                        scale: float = 1.0) -> torch.Tensor:
    """Sum a full-table tensor over ranks and keep this rank's ``sizes[rank]`` rows,
    times ``scale`` (see :func:`sum_row_blocks`).

    gloo has no reduce-scatter; an AlltoAll of row blocks and a local sum move the
    same (N-1)/N of the table a ring reduce-scatter would."""
    return reduce_scatter_rows_async(full, sizes, group, scale).wait()


def reduce_scatter_rows_async(full: torch.Tensor, sizes: Sequence[int], group: Group = None,
                              scale: float = 1.0) -> Pending:
    """:func:`reduce_scatter_rows`, asynchronously: :meth:`Pending.wait` returns this
    rank's rows of the sum (the local sum runs where the caller waits)."""
    return scatter_token_rows_async(full, sizes, group, then=lambda blocks: sum_row_blocks(blocks, scale))


def sum_row_blocks(blocks: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``blocks.sum(0) * scale``; fp16/bf16 blocks are summed in fp32 and scaled before
    their one rounding: N ranks' sum may exceed the half range where the 1/N average
    (what DDP, which divides before it sums, leaves) does not."""
    if blocks.dtype in (torch.float16, torch.bfloat16):
        acc = blocks.sum(0, dtype=torch.float32)
        return (acc.mul_(scale) if scale != 1.0 else acc).to(blocks.dtype)
    out = blocks.sum(0)
    return out.mul_(scale) if scale != 1.0 else out


def scatter_token_rows(full: torch.Tensor, sizes: Sequence[int], group: Group = None) -> torch.Tensor:
    """Every rank's version of this rank's rows, unreduced: ``full`` holds ``sum(sizes)``
    rows in rank order on every rank; block ``r`` (``sizes[r]`` rows) goes to rank ``r``,
    which gets ``world x sizes[rank] x ...``, one block per sender (an AlltoAll, no
    padding). For a per-row combination that is not a sum."""
    return scatter_token_rows_async(full, sizes, group).wait()


def scatter_token_rows_async(full: torch.Tensor, sizes: Sequence[int], group: Group = None,
                             then: Optional[Callable[[torch.Tensor], Any]] = None) -> Pending:
    """:func:`scatter_token_rows`, asynchronously; :meth:`Pending.wait` returns the
    blocks (or ``then(blocks)``, computed where the caller waits)."""
    world, me = len(sizes), rank(group)
    mine = sizes[me]
    recv = full.new_empty(world * mine, *full.shape[1:])

    def blocks(r: torch.Tensor) -> Any:
        b = r.view(world, mine, *full.shape[1:])
        return b if then is None else then(b)

    return all_to_all_single_async(recv, full, [mine] * world, list(sizes), group, then=blocks)


class _GatherRowsFromGroup(torch.autograd.Function):
    """Shard -> full table; backward: the table gradient summed over ranks, this rank's rows."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, sizes: Sequence[int], group: Group, scale: float,  # type: ignore[override]
                on_backward: Optional[Callable[[torch.Tensor], None]]):
        ctx.sizes, ctx.group, ctx.scale, ctx.on_backward = list(sizes), group, scale, on_backward
        return all_gather_rows(shard.detach(), sizes, group)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):  # type: ignore[override]
        if ctx.on_backward is not None:
            ctx.on_backward(grad_full)
        grad = reduce_scatter_rows(grad_full, ctx.sizes, ctx.group, ctx.scale)
        return grad, None, None, None, None


def gather_rows_from_group(shard: torch.Tensor, sizes: Sequence[int], group: Group = None, scale: float = 1.0,
                           on_backward: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """Differentiable :func:`all_gather_rows`: the backward reduce-scatters the table
    gradient to the rows' owners, times ``scale`` (``on_backward`` sees it first)."""
    return _GatherRowsFromGroup.apply(shard, list(sizes), group, float(scale), on_backward)
