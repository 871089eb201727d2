"""The sparse exchange's local work: PyTorch reference ops and their native versions.

Four row-level steps run on every rank around the AlltoAlls of the input and output dists:

* :func:`dedup_bucket` -- validate the ids, dedup them with an inverse index and count
  the unique ids per owner of a :class:`ShardPlan` (on plan-order ids, where every
  owner's rows are one contiguous block, whatever the layout);
* :func:`gather_rows` -- rows of a table at given indices (owners serving requests,
  requesters expanding unique rows back to the batch);
* :func:`scatter_add_rows` -- sum gradient rows into destination rows (per unique
  id, or into the shard gradient), scale them and zero the padding row;
* :func:`expand_rows` -- ``gather_rows`` with ``scatter_add_rows`` as its backward.

Each has a pure-PyTorch reference (the code path the package always had) and a
native one from the optional C++/CUDA extension ``embrace_fairseq._native``
(``csrc/``). Both give bit-identical results; the tests check it.

``EMBRACE_NATIVE`` chooses: ``0`` never native, ``1`` always (an error when the
extension is missing or stale), ``auto`` (default) only the ops listed in
:data:`AUTO_NATIVE`, which records what the committed benchmark measured. ``auto``
keeps CUDA tensors on the reference path: the CUDA kernels have not been measured.

Summation order of ``scatter_add_rows`` (what makes bit-exactness possible): it is
the one of torch's CPU ``index_add_`` along dim 0 -- per destination row, sources in
ascending position added into an accumulator of ``at::opmath_type`` (float for
half/bfloat16) that starts at zero. float rows are rounded once and ``mul_(scale)``
rounds once more; half/bfloat16 rows are scaled in fp32 and rounded once, so that an
owner's sum of N ranks' rows that would overflow half precision but whose ``1/N``
average does not stays finite (stock DDP divides before it sums). The native op (CPU
and CUDA) follows that order.

A row index outside the table raises :class:`RowIndexError` on the host, on CPU and
CUDA alike, with the same message; the CUDA kernels record a bad index in a flag
instead of a device assert, so the CUDA context stays usable. torch's
CUDA ``index_add_`` uses atomics and has no fixed order, so on GPUs the native op is
the deterministic one and the CPU reference defines the expected bits.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.ids import InvalidIdError

#: Must equal ``kApiVersion`` in csrc/embrace_native.h.
API_VERSION = 2

#: The switchable call sites: an op and what it is used for (the same op can win in
#: one use and lose in another, so ``auto`` decides per use).
OPS = (
    "dedup_bucket",  # requester: validate, dedup, count per owner
    "gather_rows.owner",  # owner: rows the other ranks asked for
    "gather_rows.expand",  # requester: unique rows back to batch positions
    "scatter_add_rows.owner",  # owner: gradient rows into the shard gradient
    "scatter_add_rows.per_unique",  # requester: batch gradient rows summed per unique id
)

#: Ops ``EMBRACE_NATIVE=auto`` runs natively (CPU tensors only). Decided from
#: results/native_ops/native_ops_bench.json (``python -m embrace_fairseq.core.native_ops
#: --bench``): on when the geometric-mean speedup over the 7 benchmark shapes is at
#: least 1.10 and no shape is slower than 0.95x the reference. Measured on a shared
#: 2-core AMD EPYC VM, torch 2.13.0+cpu, 1 thread, medians of 21 interleaved
#: repetitions (speedup = reference time / native time; geomean, worst, best):
#:   dedup_bucket                 5.40x  1.42x  11.10x  -> on  (one pass instead of
#:                                                        min/max syncs + sort-unique + searchsorted)
#:   gather_rows.owner            1.07x  0.99x   1.23x  -> off (both are memcpy-bound)
#:   gather_rows.expand           0.92x  0.52x   1.33x  -> off
#:   scatter_add_rows.owner       1.23x  0.95x   1.58x  -> off (faster on average, one shape at 0.9499x)
#:   scatter_add_rows.per_unique  1.06x  0.84x   1.50x  -> off
AUTO_NATIVE: Dict[str, bool] = {
    "dedup_bucket": True,
    "gather_rows.owner": False,
    "gather_rows.expand": False,
    "scatter_add_rows.owner": False,
    "scatter_add_rows.per_unique": False,
}

_ENV = "EMBRACE_NATIVE"
_MODES = ("auto", "0", "1")
_REPO_ROOT = Path(__file__).resolve().parents[3]


class NativeOpsUnavailable(UserError, RuntimeError):
    """``EMBRACE_NATIVE=1`` but the extension is missing, stale or lacks the device: the
    user rebuilds it or unsets the variable (the message says how)."""


class RowIndexError(InvalidIdError, IndexError):
    """A row index outside the table reached a native op (CPU or CUDA). The package's
    :class:`~embrace_fairseq.core.ids.InvalidIdError`, and an ``IndexError`` as torch's
    ``index_select`` raises for the same input."""


def _row_index_error(exc: IndexError) -> RowIndexError:
    # the op's own message (its first line: torch may append a C++ stack trace)
    return RowIndexError(str(exc).strip().splitlines()[0] if str(exc).strip() else "row index out of range")


def source_hash(root: Path = _REPO_ROOT) -> Optional[str]:
    """Digest of csrc/ (the same as setup.py compiles in), or None without a checkout."""
    files = sorted(p for p in (root / "csrc").glob("*") if p.suffix in (".cpp", ".cu", ".h"))
    if not files:
        return None
    h = hashlib.sha1()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return "h" + h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _load() -> Tuple[Optional[object], str]:
    """(extension module or None, why not)."""
    try:
        from embrace_fairseq import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"the extension is not built ({exc})"
    if getattr(_native, "API_VERSION", None) != API_VERSION:
        return None, (
            f"the built extension has API version {getattr(_native, 'API_VERSION', None)}, "
            f"this source expects {API_VERSION}: rebuild it"
        )
    expected = source_hash()
    if expected is not None and _native.SOURCE_HASH != expected:
        return None, (
            f"the built extension ({_native.SOURCE_HASH}) is older than csrc/ ({expected}): rebuild it"
        )
    return _native, ""


def native_module():
    """The loaded extension, or None (see :func:`native_status` for why)."""
    return _load()[0]


def native_status() -> str:
    mod, why = _load()
    if mod is None:
        return f"native ops unavailable: {why}"
    return f"native ops available (CUDA kernels: {'yes' if mod.WITH_CUDA else 'no'})"


def mode() -> str:
    """The ``EMBRACE_NATIVE`` setting, read on every call so tests and ranks can set it."""
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{_ENV} must be one of auto, 0, 1; got {value!r}")
    return value


_rebuild_hint = (
    "build it with `pip install --no-build-isolation --no-deps -e .` or "
    "`python setup.py build_ext --inplace` (needs a C++ compiler and torch), or set {env}=auto"
).format(env=_ENV)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def use_native(op: str, device: torch.device) -> bool:
    """Whether ``op`` (one of :data:`OPS`) runs natively for tensors on ``device`` under the current mode."""
    m = mode()
    if m == "0":
        return False
    mod, why = _load()
    if m == "1":
        if mod is None:
            raise NativeOpsUnavailable(f"{_ENV}=1 but {why}; {_rebuild_hint}")
        if device.type == "cuda" and not mod.WITH_CUDA:
            raise NativeOpsUnavailable(f"{_ENV}=1 but the extension was built without CUDA kernels (tensor on {device})")
        if device.type not in ("cpu", "cuda"):
            raise NativeOpsUnavailable(f"{_ENV}=1 but native ops handle CPU and CUDA tensors, not {device}")
        return True
    if mod is None:
        if "older than" in why or "API version" in why:
            _warn_once(f"embrace_fairseq native ops not used: {why}")
        return False
    return device.type == "cpu" and AUTO_NATIVE[op]


# --------------------------------------------------------------------- host integers
def host_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Small host integers (split sizes, boundaries, positions) as an int64 tensor on
    ``device`` without a host sync: on CUDA through pinned memory and an asynchronous
    copy (``torch.tensor(..., device=cuda)`` copies from pageable memory and blocks until
    the stream is idle). The caching host allocator keeps the pinned block until the copy
    is done."""
    t = torch.tensor(list(values), dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def _bad_id(flat_ids: torch.Tensor, num_embeddings: int) -> Optional[int]:
    """:func:`~embrace_fairseq.core.ids.validate_ids` with one host sync (kept: raising is a
    host decision) instead of one for the minimum and one for the maximum."""
    if flat_ids.numel() == 0:
        return None
    lo, hi = torch.stack(torch.aminmax(flat_ids.long())).tolist()
    return lo if lo < 0 else (hi if hi >= num_embeddings else None)


# --------------------------------------------------------------------- dedup + bucket
class Bucketed(NamedTuple):
    """Unique ids (ascending, so grouped by owner), the inverse index and per-owner
    counts; or only ``bad_id`` when some id is outside ``[0, num_embeddings)``."""

    unique_ids: Optional[torch.Tensor]
    inverse: Optional[torch.Tensor]
    send_counts: Optional[List[int]]
    bad_id: Optional[int]


def dedup_bucket_reference(flat_ids: torch.Tensor, boundaries: Sequence[int]) -> Bucketed:

    # host syncs on CUDA: the id range (one), torch.unique's output size (one), the counts
    # (one; kept: they are AlltoAll split sizes, which are host integers)
    bad = _bad_id(flat_ids, boundaries[-1])
    if bad is not None:
        return Bucketed(None, None, None, bad)
    # torch.unique sorts, and shards are contiguous ranges, so the unique ids
    # arrive already bucketed by owner; searchsorted finds the bucket edges.
    unique_ids, inverse = torch.unique(flat_ids.long(), sorted=True, return_inverse=True)
    edges = host_ints(boundaries, flat_ids.device)
    cuts = torch.searchsorted(unique_ids, edges)
    return Bucketed(unique_ids, inverse, (cuts[1:] - cuts[:-1]).tolist(), None)


def dedup_bucket_native(flat_ids: torch.Tensor, boundaries: Sequence[int], method: int = 0) -> Bucketed:
    """One native call; ``method`` 1/2 force the dense/sort algorithm (for tests; CPU
    and CUDA alike). Two host syncs on CUDA: the id range (validation, the algorithm's
    choice) and the per-owner counts (AlltoAll split sizes are host integers)."""
    unique_ids, inverse, counts, has_bad, bad_id = _require().dedup_bucket(flat_ids, list(boundaries), method)
    if has_bad:
        return Bucketed(None, None, None, int(bad_id))
    return Bucketed(unique_ids, inverse, list(counts), None)


def dedup_bucket(flat_ids: torch.Tensor, boundaries: Sequence[int]) -> Bucketed:
    """Validate, dedup and bucket ``flat_ids`` under the shard ``boundaries``
    (``ShardPlan.boundaries``: rank ``r`` owns ``[b[r], b[r+1])``)."""
    if use_native("dedup_bucket", flat_ids.device):
        return dedup_bucket_native(flat_ids, boundaries)
    return dedup_bucket_reference(flat_ids, boundaries)


# --------------------------------------------------------------------- gather
def gather_rows_reference(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, index)


def gather_rows_native(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    try:
        return _require().gather_rows(table, index)
    except IndexError as exc:
        raise _row_index_error(exc) from None


def gather_rows(table: torch.Tensor, index: torch.Tensor, use: str = "owner") -> torch.Tensor:
    """``table.index_select(0, index)`` for a 2-D table (no autograd on the native path);
    ``use`` is ``owner`` or ``expand`` (see :data:`OPS`)."""
    if use_native("gather_rows." + use, table.device):
        return gather_rows_native(table, index)
    return gather_rows_reference(table, index)


# --------------------------------------------------------------------- scatter-add
#: Row dtypes whose sums are accumulated in float32 and rounded once (``at::opmath_type``).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def scatter_add_rows_reference(
    src: torch.Tensor, index: torch.Tensor, num_rows: int, scale: float = 1.0, zero_row: Optional[int] = None
) -> torch.Tensor:
    if src.dtype in LOW_PRECISION:
        # half-precision rows are summed in fp32 and rounded once, on every device (CUDA's
        # index_add_ would accumulate in half with atomics; stock embeddings sum in fp32),
        # and scaled before that rounding: an owner sums N ranks' rows, and their sum may
        # exceed the half range where the 1/N average (what DDP leaves) does not
        acc = torch.zeros(num_rows, src.shape[1], dtype=torch.float32, device=src.device)
        acc.index_add_(0, index, src.float())
        if scale != 1.0:
            acc.mul_(scale)
        out = acc.to(src.dtype)
    else:
        out = src.new_zeros(num_rows, src.shape[1])
        out.index_add_(0, index, src)
        if scale != 1.0:
            out.mul_(scale)
    if zero_row is not None:
        out[zero_row].zero_()
    return out


def scatter_add_rows_native(
    src: torch.Tensor, index: torch.Tensor, num_rows: int, scale: float = 1.0, zero_row: Optional[int] = None
) -> torch.Tensor:
    try:
        return _require().scatter_add_rows(src, index, num_rows, float(scale), -1 if zero_row is None else int(zero_row))
    except IndexError as exc:
        raise _row_index_error(exc) from None


def scatter_add_rows(
    src: torch.Tensor,
    index: torch.Tensor,
    num_rows: int,
    scale: float = 1.0,
    zero_row: Optional[int] = None,
    use: str = "owner",
) -> torch.Tensor:
    """``zeros(num_rows, D).index_add_(0, index, src)``, times ``scale``, with row
    ``zero_row`` zeroed (no autograd on the native path); ``use`` is ``owner`` or
    ``per_unique`` (see :data:`OPS`)."""
    if use_native("scatter_add_rows." + use, src.device):
        return scatter_add_rows_native(src, index, num_rows, scale, zero_row)
    return scatter_add_rows_reference(src, index, num_rows, scale, zero_row)


# --------------------------------------------------------------------- expand (autograd)
class _ExpandRows(torch.autograd.Function):
    """rows[inverse] forward; the gradient rows summed per unique row backward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]
        return gather_rows(rows.detach(), inverse, use="expand")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return scatter_add_rows(grad.contiguous(), inverse, ctx.num_rows, use="per_unique"), None


def expand_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, inverse)`` whose backward sums gradient rows per row of
    ``rows``; the plain torch op unless a native gather or scatter-add is in use, or
    the rows are fp16/bf16 (whose gradient rows are then summed in fp32, not by the
    half-precision ``index_add_`` of ``index_select``'s backward)."""
    if (rows.dtype in LOW_PRECISION or use_native("gather_rows.expand", rows.device)
            or use_native("scatter_add_rows.per_unique", rows.device)):
        return _ExpandRows.apply(rows, inverse)
    return rows.index_select(0, inverse)


def _require():
    mod, why = _load()
    if mod is None:
        raise NativeOpsUnavailable(f"native ops requested but {why}; {_rebuild_hint}")
    return mod
