"""What one GPU can show of EmbRace's GPU paths; run by ``scripts/gpu_check.sh``.

Each check runs in its own process (``--worker NAME``) and writes one result; the
driver collects them into ``gpu_check.json`` under ``--out`` (default ``$OUT``, else
``results/gpu_check``). Checks:

* ``exchange``: an NCCL group of world size 1 with the exchange forced on
  (``EMBRACE_FORCE_EXCHANGE=1``): lookups, gradients, agreement and replica checks,
  the global norm, the tied-projection gather (synchronous and overlapped), the relaxed
  rows, the scheduled all-reduce (single-thread on NCCL) and CUDA-event timings, in
  fp32/fp16/bf16, against plain ``F.embedding``.
* ``native``: the CUDA kernels of ``embrace_fairseq._native`` bit-exact against the CPU
  reference.
* ``vocab_parallel``: the vocab-parallel loss on the device against the float64
  full-table loss: world of one (fp32, bf16 autocast, bf16) and two gloo ranks whose
  tensors live on GPU 0 (uneven and empty token counts; the asynchronous gathers).
* ``fairseq``: fp16 (``--fp16``, then ``--memory-efficient-fp16``) EmbRace vs stock fairseq (its ``--bf16`` is its TPU mode).
* ``fairseq_resume``: a ``--memory-efficient-fp16`` run resumed from its checkpoint
  repeats the uninterrupted run.
* ``deepspeed``: fp16 and bf16 ZeRO-1 EmbRace vs stock DeepSpeed, and the fp32 masters
  refreshed after a weights-only load.
* ``native_paths``, ``lifetimes``, ``relaxed_overlap``, ``timing``: see
  :mod:`gpu_check_device` (each kernel path forced; inputs of asynchronous collectives
  dropped and overwritten under allocator pressure; the relaxed rows' stream beside the
  next forward; device end times of a delayed collective).
* ``device_placement``: NCCL ranks whose model is built before anything set the device
  (:mod:`gpu_check_placement`): each on its ``LOCAL_RANK``'s GPU (two GPUs or more), two
  ranks on one GPU refused with one line on every rank, no hang.
* ``deepspeed_fp16_skip``: fp16 ZeRO-1 with ``compute_grad_norm: false``: a NaN shard
  gradient skips the step for dense weights and shards alike.
* ``one_clock``: see :mod:`gpu_check_clock` (a trace's phases, pieces and backward all on
  the device's clock, behind a device delay; a trace over two clocks refused).

``--cpu-smoke``: the same drivers on CPU/gloo where CPU can run them, the GPU-only ones
planned but not run (their command lines are recorded). ``--dry-run``: the plan only (checks,
time limits, commands), nothing run. Each check has its own time limit and process; a
failing check does not stop the others; the whole run (the native build included, whose
start ``gpu_check.sh`` passes in ``EMBRACE_GPU_CHECK_T0``) ends within ``TOTAL_S``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "harness")]

#: In running order: the quick, most telling checks first, the training runs last (what
#: the time limit cuts, if anything).
CHECKS = ["native_paths", "lifetimes", "relaxed_overlap", "timing", "one_clock", "device_placement", "exchange",
          "native", "vocab_parallel", "deepspeed_fp16_skip", "deepspeed", "fairseq", "fairseq_resume"]
GPU_ONLY = {"fairseq", "fairseq_resume", "deepspeed", "deepspeed_fp16_skip", "device_placement"}
TIMEOUTS = {"native_paths": 60, "lifetimes": 75, "relaxed_overlap": 60, "timing": 45, "one_clock": 45,
            "device_placement": 120, "exchange": 90, "native": 45,
            "vocab_parallel": 90, "deepspeed_fp16_skip": 75, "deepspeed": 150, "fairseq": 160, "fairseq_resume": 120}
TOTAL_S = 530  # everything, the native build included: under 9 minutes
MIN_CHECK_S = 20  # a check is not started with less time than this left


def _env(cpu: bool) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["EMBRACE_FORCE_EXCHANGE"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code still names the Python line in the check's log
    env["PYTHONUNBUFFERED"] = "1"  # and what the check printed before it
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("DS_ACCELERATOR", None)
    return env


def worker_command(name: str, out: Path, cpu: bool) -> List[str]:
    return [sys.executable, str(Path(__file__)), "--worker", name, "--out", str(out)] + (["--cpu-smoke"] if cpu else [])


def run_check(name: str, out: Path, cpu: bool, limit: float = None) -> Dict[str, Any]:
    """Run one check in a child process; its result, or a failure naming what happened."""
    limit = TIMEOUTS[name] if limit is None else min(TIMEOUTS[name], limit)
    if limit < MIN_CHECK_S:
        return {"name": name, "status": "fail", "seconds": 0.0, "detail": "not run: no time left in the run's budget"}
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = worker_command(name, out, cpu)
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=_env(cpu), capture_output=True, text=True, timeout=limit)
        log = proc.stdout + proc.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired as exc:
        log, code = f"timed out after {limit:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}", -1
    (out / f"{name}.log").write_text(log if isinstance(log, str) else log.decode(errors="replace"))
    if result_file.exists():
        res = json.loads(result_file.read_text())
    else:
        res = {"status": "fail", "detail": {"exit": code, "log_tail": str(log)[-3000:]}}
    res.update(name=name, seconds=round(time.time() - start, 1))
    return res


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "results" / "gpu_check"))
    ap.add_argument("--cpu-smoke", action="store_true", help="run what CPU/gloo can, plan the rest")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (checks, limits, commands); run nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in TIMEOUTS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.dry_run:
        plan = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "total_s": TOTAL_S,
                "checks": [{"name": n, "timeout_s": TIMEOUTS[n], "gpu_only": n in GPU_ONLY,
                            "command": worker_command(n, out, args.cpu_smoke)} for n in names]}
        print(json.dumps(plan, indent=1))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        import gpu_check_workers as W

        res = W.run_worker(args.worker, out, args.cpu_smoke)
        (out / f"{args.worker}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0 if res["status"] != "fail" else 1
    started = time.time()
    t0 = float(os.environ.get("EMBRACE_GPU_CHECK_T0") or started)  # the shell's start (before any build)
    results = []
    for n in names:
        results.append(run_check(n, out, args.cpu_smoke, TOTAL_S - (time.time() - t0)))
        # written after every check: a run cut short still leaves what it found
        _write_summary(out, args.cpu_smoke, started, results, partial=True)
    summary = _write_summary(out, args.cpu_smoke, started, results, partial=False)
    for r in results:
        print(f"{r['status']:5s} {r['name']:20s} {r['seconds']:7.1f} s")
    print(f"passed {summary['passed']}, failed {len(summary['failed'])}, skipped {len(summary['skipped'])}; "
          f"results: {out / 'gpu_check.json'}")
    return 1 if summary["failed"] else 0


def _write_summary(out: Path, cpu: bool, started: float, results: List[Dict[str, Any]], partial: bool) -> Dict[str, Any]:
    summary = {"mode": "cpu-smoke" if cpu else "gpu", "seconds": round(time.time() - started, 1),
               "partial": partial,
               "passed": sum(r["status"] == "pass" for r in results),
               "failed": [r["name"] for r in results if r["status"] == "fail"],
               "skipped": [r["name"] for r in results if r["status"] == "skip"],
               "environment": _environment(), "checks": results}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _commit() -> str:
    """The commit the checks ran on (``EMBRACE_COMMIT`` first: :func:`source_state`)."""
    from embrace_fairseq.perf.provenance import source_state

    state = source_state(ROOT)
    return (state["commit"] or "unknown") + ("+changes" if state["dirty"] else "")


@functools.lru_cache(maxsize=1)
def _environment() -> Dict[str, Any]:
    import torch

    env = {"commit": _commit(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


if __name__ == "__main__":
    sys.exit(main())
