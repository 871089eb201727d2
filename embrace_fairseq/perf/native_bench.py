"""Micro-benchmark of the native ops against their PyTorch references.

``python -m embrace_fairseq.perf.native_bench --bench [--out results/native_ops] [--quick]``

Inputs are shaped like one rank's share of a step: a batch of ids drawn from a
Zipf law over the vocabulary (ids in frequency order, as in a fairseq dictionary,
so the first shard is the busiest), the owner side of rank 0 (the requests of all
ranks for its rows) and the requester side (unique rows expanded to the batch, and
back). Reference and native calls alternate within every repetition and their
order flips each repetition, so machine noise hits both alike; the figure kept is
the median. Every case is also checked for bit-identical outputs.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from embrace_fairseq.core import native_ops as N
from embrace_fairseq.core.native_ops import AUTO_NATIVE, OPS, native_status
from embrace_fairseq.core.shard_plan import ShardPlan

# (ids per rank, vocab, dim, world): spans 2k-64k ids, 8k-256k vocab, dim 256-1024, 2-8 ranks.
FULL_CONFIGS = [
    (2048, 8192, 256, 2),
    (8192, 32768, 512, 4),
    (16384, 65536, 1024, 8),
    (32768, 131072, 512, 4),
    (65536, 262144, 256, 8),
    (65536, 65536, 512, 2),
    (4096, 262144, 1024, 2),
]
QUICK_CONFIGS = FULL_CONFIGS[:2]
ZIPF_S = 1.0  # word frequencies: p(rank k) ~ 1/k
SPECIALS = 4  # fairseq's <s>, <pad>, </s>, <unk> come first

# Rule for EMBRACE_NATIVE=auto (native_ops.AUTO_NATIVE is set from it by hand).
MIN_GEOMEAN = 1.10
MIN_WORST = 0.95


def zipf_ids(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    k = torch.arange(1, vocab - SPECIALS + 1, dtype=torch.float64)
    p = k.pow(-ZIPF_S)
    return SPECIALS + torch.multinomial(p / p.sum(), n, replacement=True, generator=gen)


Case = Tuple[str, str, Dict, Callable[[], object], Callable[[], object]]


def build_cases(n: int, vocab: int, dim: int, world: int, seed: int = 0) -> List[Case]:
    gen = torch.Generator().manual_seed(seed)
    plan = ShardPlan(vocab, world, "contiguous")  # ids below are used as plan-order ids
    bounds = plan.boundaries
    ids = zipf_ids(n, vocab, gen)
    # owner side of rank 0: every rank's unique ids that fall in rank 0's shard
    start, end = plan.shard_range(0)
    requested = []
    for r in range(world):
        u = torch.unique(zipf_ids(n, vocab, gen))
        requested.append(u[(u >= start) & (u < end)] - start)
    local = torch.cat(requested)
    shard = torch.randn(end - start, dim, generator=gen)
    recv = torch.randn(local.numel(), dim, generator=gen)
    unique_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    unique_rows = torch.randn(unique_ids.numel(), dim, generator=gen)
    grad = torch.randn(n, dim, generator=gen)
    scale = 1.0 / world
    cfg = {"ids": n, "vocab": vocab, "dim": dim, "world": world}
    return [
        ("dedup_bucket", f"{n} ids -> {unique_ids.numel()} unique",
         cfg, lambda: N.dedup_bucket_reference(ids, bounds), lambda: N.dedup_bucket_native(ids, bounds)),
        ("gather_rows.owner", f"{local.numel()} of {end - start} rows",
         cfg, lambda: N.gather_rows_reference(shard, local), lambda: N.gather_rows_native(shard, local)),
        ("gather_rows.expand", f"{unique_ids.numel()} -> {n} rows",
         cfg, lambda: N.gather_rows_reference(unique_rows, inverse), lambda: N.gather_rows_native(unique_rows, inverse)),
        ("scatter_add_rows.owner", f"{local.numel()} rows into {end - start}",
         cfg, lambda: N.scatter_add_rows_reference(recv, local, end - start, scale, 1),
         lambda: N.scatter_add_rows_native(recv, local, end - start, scale, 1)),
        ("scatter_add_rows.per_unique", f"{n} rows into {unique_ids.numel()}",
         cfg, lambda: N.scatter_add_rows_reference(grad, inverse, unique_ids.numel()),
         lambda: N.scatter_add_rows_native(grad, inverse, unique_ids.numel())),
    ]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_benchmark(out_dir: str, quick: bool = False, reps: int = None, threads: int = 1) -> int:
    if N.native_module() is None:
        print(N.native_status())
        return 2
    torch.set_num_threads(threads)
    reps = reps or (3 if quick else 21)
    configs = QUICK_CONFIGS if quick else FULL_CONFIGS
    cases = [c for cfg in configs for c in build_cases(*cfg)]
    for op, use, cfg, ref, nat in cases:  # warm-up and the bit-exactness check
        if not _same(ref(), nat()):
            raise AssertionError(f"native {op} ({use}, {cfg}) differs from the reference")
    times = [([], []) for _ in cases]
    for rep in range(reps):
        for (op, use, cfg, ref, nat), (t_ref, t_nat) in zip(cases, times):
            if rep % 2 == 0:
                t_ref.append(_time(ref))
                t_nat.append(_time(nat))
            else:
                t_nat.append(_time(nat))
                t_ref.append(_time(ref))
    rows = []
    for (op, use, cfg, _, _), (t_ref, t_nat) in zip(cases, times):
        r, m = statistics.median(t_ref), statistics.median(t_nat)
        rows.append({"op": op, "use": use, **cfg, "reference_us": r * 1e6, "native_us": m * 1e6,
                     "speedup": r / m, "identical": True})
    summary = summarise(rows)
    result = {
        "command": "python -m embrace_fairseq.perf.native_bench --bench" + (" --quick" if quick else ""),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "threads": threads,
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "repetitions": reps,
        "rule": f"native by default when geomean speedup >= {MIN_GEOMEAN} and every case >= {MIN_WORST}",
        "cases": rows,
        "summary": summary,
    }
    os.makedirs(out_dir, exist_ok=True)
    stem = "native_ops_bench_quick" if quick else "native_ops_bench"
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=2)
    md = markdown_table(result)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def summarise(rows: Sequence[Dict]) -> Dict[str, Dict]:
    """Per op: geometric mean, worst and best speedup over its cases, and whether the
    rule (:data:`MIN_GEOMEAN`, :data:`MIN_WORST`) makes it native under ``auto``."""
    summary = {}
    for op in N.OPS:
        s = [row["speedup"] for row in rows if row["op"] == op]
        geo = math.exp(sum(math.log(x) for x in s) / len(s))
        summary[op] = {"geomean_speedup": geo, "worst_speedup": min(s), "best_speedup": max(s),
                       "faster": geo >= MIN_GEOMEAN and min(s) >= MIN_WORST}
    return summary


def markdown_table(result: Dict) -> str:
    lines = [
        f"Reference (PyTorch) vs native, median of {result['repetitions']} interleaved repetitions, "
        f"{result['threads']} thread(s), torch {result['torch']}, {result['cpu']}.",
        "",
        "| op.use | case | ids | vocab | dim | world | reference µs | native µs | speedup |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["cases"]:
        lines.append(
            f"| {r['op']} | {r['use']} | {r['ids']} | {r['vocab']} | {r['dim']} | {r['world']} | "
            f"{r['reference_us']:.0f} | {r['native_us']:.0f} | {r['speedup']:.2f}x |"
        )
    lines += ["", "| op.use | geomean speedup | worst | best | faster by the rule |", "|---|---:|---:|---:|---|"]
    for op, s in result["summary"].items():
        lines.append(f"| {op} | {s['geomean_speedup']:.2f}x | {s['worst_speedup']:.2f}x | "
                     f"{s['best_speedup']:.2f}x | {'yes' if s['faster'] else 'no'} |")
    lines += ["", f"Rule: {result['rule']}.", ""]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.native_bench", description="Native ops status and benchmark.")
    p.add_argument("--bench", action="store_true", help="time reference vs native ops and write JSON + Markdown")
    p.add_argument("--out", default="results/native_ops", help="folder for the benchmark results")
    p.add_argument("--quick", action="store_true", help="two small cases, few repetitions (a smoke run)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions per case (default 21, quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (ranks here run with 1)")
    args = p.parse_args(argv)
    print(native_status())
    if not args.bench:
        print("auto enables:", [op for op in OPS if AUTO_NATIVE[op]] or "none")
        return 0
    return run_benchmark(args.out, quick=args.quick, reps=args.reps, threads=args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
