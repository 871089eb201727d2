"""Per-rank bodies of the collectives' lifetime and fp16 headroom tests (real gloo ranks)."""
from __future__ import annotations

import gc
import time
import weakref
from typing import Any, Dict, List

import torch

from embrace_fairseq.core import collectives as C
from embrace_fairseq.schedule.executor import ScheduledAllReduce
from embrace_fairseq.schedule.plan import ScheduleOptions, TensorSpec, build_schedule


def async_input_lifetimes(rank: int, world: int) -> Dict[str, Any]:
    """Inputs no caller holds (as a relaxed rows' ``send`` or a stacked column block) of
    each asynchronous collective: alive while in flight, released after ``wait()``."""
    if rank == 1:
        time.sleep(0.3)  # rank 0's collectives are in flight meanwhile
    refs: List[weakref.ref] = []
    pendings = []

    def held(t: torch.Tensor) -> torch.Tensor:
        refs.append(weakref.ref(t))
        return t

    pendings.append(C.all_gather_async(held(torch.full((3,), float(rank))), None))
    recv = torch.empty(4)
    pendings.append(C.all_to_all_single_async(recv, held(torch.full((4,), float(rank))), [2, 2], [2, 2]))
    sizes = [1, 2]  # uneven: the rows go out as a copy made inside (one per peer), held by nobody else
    rows = torch.full((sizes[rank], 2), float(rank + 1))
    pendings.append(C.gather_token_rows_async(rows, sizes))
    copies = [t for t in pendings[-1]._keep if t.shape == (world * sizes[rank], 2)]
    assert len(copies) == 1, [t.shape for t in pendings[-1]._keep]
    held(copies[0])
    del copies, rows
    gc.collect()
    before = sum(r() is not None for r in refs)
    results = [p.wait() for p in pendings]
    gc.collect()
    after = sum(r() is not None for r in refs)
    ok = ([t.tolist() for t in results[0]] == [[0.0] * 3, [1.0] * 3]
          and results[1].tolist() == [0.0, 0.0, 1.0, 1.0]
          and results[2].tolist() == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    return {"count": len(refs), "before": before, "after": after, "results_ok": ok}


def fp16_headroom(rank: int, world: int, value: float) -> Dict[str, Any]:
    """The scheduled all-reduce of half-precision gradients whose sum over the ranks
    overflows half precision while their average does not."""
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    specs = [TensorSpec("p", p.numel(), p.element_size(), 0)]
    opts = ScheduleOptions(piece_bytes=8, bucket_bytes=16, max_in_flight=2, compute_bytes_per_s=1e9,
                           link_bytes_per_s=1e9)
    red = ScheduledAllReduce([p], build_schedule(specs, opts), C.new_group())
    (p * torch.full((8,), value, dtype=torch.float16)).sum().backward()
    red.finish()
    return {"grad": p.grad.float().tolist()}


def lifetimes_and_fp16(rank: int, world: int, value: float) -> Dict[str, Any]:
    """Both bodies in one set of ranks (one start-up for the default suite)."""
    out = async_input_lifetimes(rank, world)
    out.update(fp16_headroom(rank, world, value))
    return out
