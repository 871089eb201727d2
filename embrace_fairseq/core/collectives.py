"""Every collective the package issues, on the device its process group needs.

One module, in the style of Megatron's ``mappings.py``: small public functions, one per
collective; where a collective is part of autograd, a private ``autograd.Function``
with a public wrapper (:func:`gather_rows_from_group`). No other module of the package
calls a ``torch.distributed`` collective (``tests/core/test_collective_discipline.py``).

Backends (:func:`backend_for`, the one answer to "which backend runs a tensor on device
``d`` in group ``g``"): read from the group's backend *configuration*, the per-device
table torch really built (:func:`torch.distributed.get_backend_config`), never from the
name it was asked for. ``"cpu:gloo,cuda:nccl"`` runs CUDA tensors on NCCL and CPU
tensors on gloo; a bare ``init_process_group()`` (backend ``"undefined"``) builds only
the accelerator's default backend (NCCL on a CUDA machine, gloo without one).

Placement (:func:`placement`, a pure function of that table): a tensor on a device the
group has a backend for stays there, except that NCCL takes the current CUDA device
only; a tensor on a device it has none for (a few agreement integers, a digest, a
validation total on the CPU of an NCCL-only group) is staged to one it has (CUDA first)
and the result copied back.

Communicators are created eagerly: :func:`new_group` warms a new group up with a
one-element all-reduce, so no communicator is set up in the middle of a step (NCCL
creates them lazily at the first collective otherwise).

Asynchronous collectives return a :class:`Pending`, which holds every tensor the
collective reads or writes until :meth:`Pending.wait` has ordered the caller after it
(on CUDA also recorded on the stream that waits for the collective, so the caching
allocator cannot hand the memory to another stream early): ProcessGroupNCCL keeps them
alive only until the first ``wait()``, and that wait may order another stream. Its
completion and timing come from CUDA events on CUDA devices (``work.wait()`` on NCCL
only orders streams: it does not block the host) and from the work's future on gloo.

Issue order: every collective goes through :func:`_issuing` right before it is handed
to torch. It runs the registered issue fences (:func:`add_issue_fence`: the dense
schedule's single-thread mode settles its all-reduces there, so that every rank issues
them at the same place relative to the other collectives) and, with
``EMBRACE_ISSUE_LOG=DIR``, writes one line per collective as issued to
``DIR/issue.rank<N>.log``: sequence number, op, group (its name and ranks), element
count (``var`` where the ranks' counts differ by design: AlltoAlls with splits,
pickled objects). Collectives on host-side vote groups (:func:`new_group` with
``host_vote=True``) are not part of the device issue order and are not logged.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Group = Optional["dist.ProcessGroup"]

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}

#: torch's default backend per device type (``Backend.default_device_backend_map``), for
#: a configuration that names no device
_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
#: devices a single-name backend serves (``Backend.backend_capability``)
_CAPABILITY = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "ucc": ("cpu", "cuda"), "mpi": ("cpu", "cuda")}


def _now_us() -> float:
    return time.perf_counter() * 1e6


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

    * a device the group has a backend for: as given, except that NCCL takes the
      current CUDA device only;
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
    return torch.cuda.current_device() if torch.cuda.is_available() else None


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


def _placed(t: torch.Tensor, group: Group) -> Tuple[torch.Tensor, bool]:
    d = device_for(group, t.device)
    if t.device == d:
        return t, False
    return t.to(d), True


def _op(op: str) -> Any:
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


# --------------------------------------------------------------------------- issue point: fences and log
_FENCES: List[Callable[[str, Group], None]] = []
_FENCE_STATE = threading.local()
_LOG_LOCK = threading.Lock()
_LOG: Dict[str, Any] = {"file": None, "seq": 0, "dir": None}
_HOST_VOTE_GROUPS: set = set()


def add_issue_fence(fence: Callable[[str, Group], None]) -> None:
    """Call ``fence(op, group)`` before every collective issued from now on (not from
    inside a fence): where the dense schedule's single-thread mode settles what it has
    issued so far (see ``schedule/issue.py``)."""
    _FENCES.append(fence)


def remove_issue_fence(fence: Callable[[str, Group], None]) -> None:
    if fence in _FENCES:
        _FENCES.remove(fence)


class fences_off:
    """Collectives issued in this ``with`` body, on this thread, pass no fence: the
    fence's owner's own (the dense pieces, the fence's vote)."""

    def __enter__(self) -> None:
        self._was = getattr(_FENCE_STATE, "inside", False)
        _FENCE_STATE.inside = True

    def __exit__(self, *exc: Any) -> None:
        _FENCE_STATE.inside = self._was


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


def _issue_log() -> Any:
    path = os.environ.get("EMBRACE_ISSUE_LOG")
    if not path:
        return None
    if _LOG["dir"] != path:
        os.makedirs(path, exist_ok=True)
        if _LOG["file"] is not None:
            _LOG["file"].close()
        _LOG["file"] = open(os.path.join(path, f"issue.rank{rank()}.log"), "w", buffering=1)
        _LOG["dir"], _LOG["seq"] = path, 0
    return _LOG["file"]


def _issuing(op: str, group: Group, numel: Any) -> None:
    """A collective is about to be issued: run the fences, then log it (see module doc)."""
    if _FENCES and not getattr(_FENCE_STATE, "inside", False):
        _FENCE_STATE.inside = True
        try:
            for fence in list(_FENCES):
                fence(op, group)
        finally:
            _FENCE_STATE.inside = False
    if not os.environ.get("EMBRACE_ISSUE_LOG") or not is_distributed():
        return
    label = group_label(group)
    if label in _HOST_VOTE_GROUPS:
        return
    with _LOG_LOCK:
        f = _issue_log()
        _LOG["seq"] += 1
        f.write(f"{_LOG['seq']} {op} {label} {numel}\n")


# --------------------------------------------------------------------------- groups
def new_group(ranks: Optional[Sequence[int]] = None, host_vote: bool = False) -> Group:
    """A new process group over ``ranks`` (all by default), created and warmed up now.
    Collective over the default group: every rank calls it in the same order.

    ``host_vote``: a gloo group for small host-side votes (CPU tensors), outside the
    device issue order of the other groups (and of the issue log)."""
    if not is_distributed():
        return None
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if host_vote:
        group = dist.new_group(ranks=ranks, backend="gloo")
        _HOST_VOTE_GROUPS.add(group_label(group))
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
    _issuing("all_reduce", group, placed.numel())
    dist.all_reduce(placed, op=_op(op), group=group)
    if moved:
        tensor.copy_(placed)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group = None) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (equal shapes on every rank), on ``tensor``'s device."""
    placed, moved = _placed(tensor.contiguous(), group)
    parts = [torch.empty_like(placed) for _ in range(world_size(group))]
    _issuing("all_gather", group, placed.numel())
    dist.all_gather(parts, placed, group=group)
    return [p.to(tensor.device) for p in parts] if moved else parts


def all_gather_object(obj: Any, group: Group = None) -> List[Any]:
    """Every rank's picklable ``obj`` (torch stages it on the group's device)."""
    out: List[Any] = [None] * world_size(group)
    _issuing("all_gather_object", group, "var")
    dist.all_gather_object(out, obj, group=group)
    return out


def _a2a_count(t: torch.Tensor, splits: Optional[List[int]]) -> Any:
    return t.numel() if splits is None else "var"


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Group = None) -> torch.Tensor:
    """AlltoAll of row blocks (uneven splits allowed) into ``output``. Returns it."""
    out_p, moved = _placed(output, group)
    in_p, _ = _placed(input.contiguous(), group)
    _issuing("all_to_all", group, _a2a_count(in_p, input_split_sizes))
    dist.all_to_all_single(out_p, in_p, output_split_sizes, input_split_sizes, group=group)
    if moved:
        output.copy_(out_p)
    return output


def barrier(group: Group = None) -> None:
    """Every rank of ``group`` reaches this point (NCCL: on the current device)."""
    _issuing("barrier", group, 0)
    table = _group_table(group)
    if "cpu" not in table and table.get("cuda") == "nccl" and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


# --------------------------------------------------------------------------- asynchronous
_WAIT_STREAMS: dict = {}
_CLOCK_ANCHORS: dict = {}  # device -> (event, host time when it completed, us)


def _clock_anchor(device: torch.device) -> Tuple[Any, float]:
    """An event on ``device`` and the host time it completed: the origin for turning a
    later event of the device into a time on :func:`time.perf_counter`'s clock. Taken
    once per device (one synchronisation, on the first asynchronous collective)."""
    if device not in _CLOCK_ANCHORS:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
        ev.synchronize()
        _CLOCK_ANCHORS[device] = (ev, _now_us())
    return _CLOCK_ANCHORS[device]


def event_us(event: Any, device: torch.device) -> float:
    """When a (completed, timing) CUDA ``event`` of ``device`` completed, on
    :func:`time.perf_counter`'s clock in microseconds (through the device's anchor)."""
    anchor, anchor_us = _clock_anchor(device)
    event.synchronize()
    return anchor_us + anchor.elapsed_time(event) * 1000.0


def record_event(device: torch.device) -> Any:
    """A timing CUDA event recorded now on ``device``'s current stream (the anchor is
    taken first, so that :func:`event_us` can place it)."""
    _clock_anchor(device)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


def _wait_stream(device: torch.device, group: Group) -> Any:
    """The stream that waits for ``group``'s collectives on ``device``: one per group, so
    an end event waits for its own collective (and the group's earlier ones, which
    complete first anyway), never for another group's."""
    key = (device, group_label(group))
    if key not in _WAIT_STREAMS:
        _WAIT_STREAMS[key] = torch.cuda.Stream(device=device)
    return _WAIT_STREAMS[key]


class Pending:
    """An asynchronous collective in flight.

    :meth:`wait` makes its result usable where the caller runs (gloo: blocks the host;
    NCCL: orders the current stream after it, as torch does) and returns it;
    :meth:`synchronize` blocks the host until the collective has *finished* (a CUDA
    event on CUDA devices), which is what a credit needs.

    Lifetimes: ``keep`` is every tensor the collective reads or writes (the launchers
    below pass them). They are held until :meth:`wait` has ordered the caller after the
    collective, on every backend; on CUDA they are also recorded on the group's wait
    stream (which waits for the collective), so memory a caller freed meanwhile is not
    reused by any stream before the collective is done.

    Times, on :func:`time.perf_counter`'s clock in microseconds, both from the same
    source: on CPU, :attr:`issued_us` is when it was issued and :meth:`end_us` when the
    work's future ran its completion callback; on CUDA both are device events on the
    group's wait stream -- a start event once the caller's stream reached the issue and
    the group's earlier collectives were done, an end event after the collective --
    placed on the host clock through a per-device anchor event (:func:`_clock_anchor`;
    the future's callbacks of NCCL work run when the work is enqueued, not finished).
    :attr:`host_issued_us` is the host's issue time on every device. On CPU the callback
    needs the interpreter lock: while other Python threads run it can be late by up to
    ``sys.getswitchinterval()`` (5 ms by default).
    """

    def __init__(self, launch: Callable[[], Any], device: torch.device,
                 finish: Optional[Callable[[], Any]] = None, keep: Sequence[torch.Tensor] = (),
                 group: Group = None) -> None:
        self.device = device
        self._finish = finish
        self._keep: Tuple[torch.Tensor, ...] = tuple(t for t in keep if torch.is_tensor(t))
        self._result: Any = None
        self._waited = False
        self._end: Optional[float] = None
        self._ended = threading.Event()
        self._cuda = device.type == "cuda"
        if self._cuda:
            _clock_anchor(device)
            self._start_ev = torch.cuda.Event(enable_timing=True)
            self._end_ev = torch.cuda.Event(enable_timing=True)
        self.host_issued_us = _now_us()
        self._work = launch()
        if self._cuda:
            stream = _wait_stream(device, group)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._start_ev.record(stream)
            with torch.cuda.stream(stream):
                self._work.wait()  # the wait stream waits for the collective's own stream
                self._end_ev.record(stream)
            for t in self._keep:
                if t.device.type == "cuda":
                    t.record_stream(stream)
        else:
            self._work.get_future().then(self._mark_end)

    @property
    def issued_us(self) -> float:
        """When the collective was issued: the host's time on CPU, the device start event
        on CUDA (waits for it)."""
        return event_us(self._start_ev, self.device) if self._cuda else self.host_issued_us

    def _mark_end(self, _fut: Any) -> None:
        self._end = _now_us()
        self._ended.set()

    def wait(self) -> Any:
        if not self._waited:
            self._work.wait()
            self._waited = True
            if self._finish is not None:
                self._result = self._finish()
            # the caller is ordered after the collective now: its tensors may go
            self._finish, self._keep = None, ()
            if not self._cuda:
                self._work = None  # gloo's work holds its tensors until it is destroyed
        return self._result

    def synchronize(self) -> None:
        """Block the host until the collective has finished."""
        if self._cuda:
            self._end_ev.synchronize()
        elif self._work is not None:
            self._work.wait()

    def done(self) -> bool:
        if self._cuda:
            return bool(self._end_ev.query())
        return self._work is None or bool(self._work.is_completed())

    def end_us(self) -> float:
        """When the collective completed (waits for it)."""
        self.synchronize()
        if self._cuda:
            return event_us(self._end_ev, self.device)
        # the future's callback runs at completion, at the latest right after the waiters wake
        if not self._ended.wait(timeout=60.0):
            raise RuntimeError("a completed collective's future never ran its completion callback")
        assert self._end is not None
        return self._end


def all_reduce_async(tensor: torch.Tensor, group: Group = None) -> Pending:
    """Sum ``tensor`` over ``group`` in place, asynchronously."""
    placed, moved = _placed(tensor, group)

    def finish() -> torch.Tensor:
        if moved:
            tensor.copy_(placed)
        return tensor

    def launch() -> Any:
        _issuing("all_reduce", group, placed.numel())
        return dist.all_reduce(placed, group=group, async_op=True)

    return Pending(launch, placed.device, finish, keep=(placed, tensor), group=group)

class _FutureWork:
    """The work handle (for :class:`Pending`) of collectives run by a worker thread: its
    future is completed, or given the error, when they are done."""

    def __init__(self) -> None:
        self.future: Any = torch.futures.Future()

    def wait(self) -> bool:
        self.future.wait()  # raises the worker's error
        return True

    def is_completed(self) -> bool:
        return bool(self.future.done())

    def get_future(self) -> Any:
        return self.future


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
        _issuing("all_gather", group, placed.numel())
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
        _issuing("all_to_all", group, _a2a_count(in_p, input_split_sizes))
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
            _issuing("all_gather", group, placed.numel())
            return dist.all_gather(parts, placed, group=group, async_op=True)

        return Pending(launch, placed.device, finish, keep=(placed, staged), group=group)
    return all_to_all_single_async(out, rows.repeat(world, *([1] * (rows.dim() - 1))), list(sizes),
                                   [rows.shape[0]] * world, group)


def reduce_scatter_rows(full: torch.Tensor, sizes: Sequence[int], group: Group = None) -> torch.Tensor:
    """Sum a full-table tensor over ranks and keep this rank's ``sizes[rank]`` rows.

    gloo has no reduce-scatter; an AlltoAll of row blocks and a local sum move the
    same (N-1)/N of the table a ring reduce-scatter would."""
    return reduce_scatter_rows_async(full, sizes, group).wait()


def reduce_scatter_rows_async(full: torch.Tensor, sizes: Sequence[int], group: Group = None) -> Pending:
    """:func:`reduce_scatter_rows`, asynchronously: :meth:`Pending.wait` returns this
    rank's rows of the sum (the local sum runs where the caller waits)."""
    return scatter_token_rows_async(full, sizes, group, then=lambda blocks: blocks.sum(0))


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
        grad = reduce_scatter_rows(grad_full, ctx.sizes, ctx.group)
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        return grad, None, None, None, None


def gather_rows_from_group(shard: torch.Tensor, sizes: Sequence[int], group: Group = None, scale: float = 1.0,
                           on_backward: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """Differentiable :func:`all_gather_rows`: the backward reduce-scatters the table
    gradient to the rows' owners, times ``scale`` (``on_backward`` sees it first)."""
    return _GatherRowsFromGroup.apply(shard, list(sizes), group, float(scale), on_backward)
