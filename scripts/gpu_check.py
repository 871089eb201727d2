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
* ``fairseq``: fp16 and bf16 (``--memory-efficient-*``) EmbRace vs stock fairseq.
* ``fairseq_resume``: a ``--memory-efficient-fp16`` run resumed from its checkpoint
  repeats the uninterrupted run.
* ``deepspeed``: fp16 and bf16 ZeRO-1 EmbRace vs stock DeepSpeed, and the fp32 masters
  refreshed after a weights-only load.

``--cpu-smoke``: the same drivers on CPU/gloo where CPU can run them (``exchange``,
``native``, ``vocab_parallel``), the GPU-only ones planned but not run (their command lines are recorded).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "harness")]

CHECKS = ["exchange", "native", "vocab_parallel", "fairseq", "fairseq_resume", "deepspeed"]
GPU_ONLY = {"fairseq", "fairseq_resume", "deepspeed"}
TIMEOUTS = {"exchange": 90, "native": 60, "vocab_parallel": 90, "fairseq": 160, "fairseq_resume": 120, "deepspeed": 150}
BUDGET_S = 480  # all checks together (the native build, if any, runs before)


def _env(cpu: bool) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["EMBRACE_FORCE_EXCHANGE"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("DS_ACCELERATOR", None)
    return env


def run_check(name: str, out: Path, cpu: bool, limit: float = None) -> Dict[str, Any]:
    """Run one check in a child process; its result, or a failure naming what happened."""
    limit = TIMEOUTS[name] if limit is None else min(TIMEOUTS[name], limit)
    if limit < 20:
        return {"name": name, "status": "fail", "seconds": 0.0, "detail": "no time left in the check's budget"}
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__)), "--worker", name, "--out", str(out)] + (["--cpu-smoke"] if cpu else [])
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
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        import gpu_check_workers as W

        res = W.run_worker(args.worker, out, args.cpu_smoke)
        (out / f"{args.worker}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0 if res["status"] != "fail" else 1
    started = time.time()
    results = [run_check(n, out, args.cpu_smoke, BUDGET_S - (time.time() - started))
               for n in args.only.split(",") if n]
    summary = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "seconds": round(time.time() - started, 1),
               "passed": sum(r["status"] == "pass" for r in results),
               "failed": [r["name"] for r in results if r["status"] == "fail"],
               "skipped": [r["name"] for r in results if r["status"] == "skip"],
               "environment": _environment(), "checks": results}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    for r in results:
        print(f"{r['status']:5s} {r['name']:15s} {r['seconds']:7.1f} s")
    print(f"results: {out / 'gpu_check.json'}")
    return 1 if summary["failed"] else 0


def _environment() -> Dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


if __name__ == "__main__":
    sys.exit(main())
