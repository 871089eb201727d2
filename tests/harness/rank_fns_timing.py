"""Per-rank body of the hidden-share timing test: a known sleep pattern on 2 gloo ranks.

Rank 1 controls how long rank 0's collectives take by sleeping before it enters them;
rank 0 issues them asynchronously, computes (sleeps inside a traced backward phase)
for a known time, and reads each collective's completion time only well after it
completed, as a busy thread would. Times in seconds from rank 0's issue of the first
collective (the two ranks leave a barrier together first):

    rank 0: all-reduce A issued at 0; backward [0, C); idle until L; reads A's end;
            all-reduce B issued at L, waited for at once
    rank 1: enters A at D1; enters B at L + D2

    A = [0, D1], B = [L, L + D2]; hidden = min(C, D1); comm = D1 + D2
"""
from __future__ import annotations

import time
from typing import Dict

import torch

C, D1, L, D2 = 0.3, 0.5, 0.8, 0.2
EXPECTED_SHARE = min(C, D1) / (D1 + D2)


def sleep_pattern(rank: int, world: int) -> Dict[str, float]:
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.trace import Tracer

    tracer = Tracer(rank=rank)
    x = torch.ones(4)
    collectives.barrier()
    t0 = time.perf_counter()
    if rank == 1:
        time.sleep(D1)
        collectives.all_reduce(x)
        time.sleep(max(0.0, t0 + L + D2 - time.perf_counter()))
        collectives.all_reduce(x)
        return {}
    a = collectives.all_reduce_async(x)
    with tracer.phase("backward"):
        time.sleep(C)
    time.sleep(max(0.0, t0 + L - time.perf_counter()))  # A completed at D1 < L: look late
    tracer.collective("dense_grad", 16, a.issued_us, a.end_us())
    b = collectives.all_reduce_async(x)
    b.wait()
    tracer.collective("dense_grad", 16, b.issued_us, b.end_us())
    s = tracer.summary()
    return {"hidden_share": s["hidden_share"], "comm_seconds": s["comm_seconds"],
            "hidden_seconds": s["hidden_seconds"], "exposed_seconds": s["exposed_seconds"]}
