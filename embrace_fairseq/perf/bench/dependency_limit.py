"""The dependency-aware limit of finished regime runs.

Runs measured before their profile timed the output stretch (:mod:`.stretch`) hold no
stretch; this times it for each of their workloads (the stock model, one process, the
runs' own batches of rank 0) and applies it to every run (:func:`.report.dependency_limit`):

    python -m embrace_fairseq.perf.bench.dependency_limit results/bench/regime/mbart_w2/* \\
        --out results/bench/regime/dependency_limit

writes ``dependency_limit.json`` (the stretches, the limits, every EmbRace strategy's step
over them, the commit) and ``dependency_limit.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

from embrace_fairseq.perf.provenance import source_state

REPO_ROOT = Path(__file__).resolve().parents[3]


def time_stretch(model_name: str, world: int, data: Path, steps: int = 5) -> Dict[str, float]:
    """The output stretch of ``model_name``'s stock model, its share of the stock step."""
    import torch

    from embrace_fairseq.perf.bench import workloads as W
    from embrace_fairseq.perf.bench.stretch import profile_steps

    torch.set_num_threads(1)  # as each bench rank
    cache = Path(tempfile.gettempdir()) / "embrace_bench_cache"
    W.prepare_shared_inputs([model_name], data, cache)
    w = W.workloads(False)[model_name]
    batches = W.build_task_and_batches(w, world, data, cache)
    model = W.build_model(w, w.stock_arch, batches.task, data)
    criterion = W.build_criterion(w, batches.task)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_of(i: int):
        loss, ss, _ = criterion(model, batches.get(i, 0))
        return loss / max(1, ss)

    return profile_steps(model, w.tables, loss_of, opt, steps)["stretch"]


def time_stretch_apart(model_name: str, world: int, data: Path, steps: int, allocator: str = "auto") -> Dict[str, Any]:
    """:func:`time_stretch` in a process of its own with the bench ranks' allocator
    (:mod:`.allocator`: with glibc's the output layer's large blocks fault in again every
    step, which lengthens the stretch more than the rest of the step)."""
    from embrace_fairseq.perf.bench.allocator import allocator_env

    extra, what = allocator_env(allocator, os.environ)
    proc = subprocess.run([sys.executable, "-m", "embrace_fairseq.perf.bench.dependency_limit", "--time-one", model_name, "--world", str(world),
                           "--data", str(data), "--steps", str(steps)],
                          env=dict(os.environ, **extra), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"timing {model_name}'s output stretch failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), allocator=what)


def _embrace_rows(key: str, dep: Dict[str, Any], plain: Dict[str, Any]) -> List[Dict[str, Any]]:
    from embrace_fairseq.perf.strategies import get_strategy

    return [{"run": key, "strategy": s, "over_dependency_limit": o, "over_limit": plain["over_limit"][s]}
            for s, o in dep["over_limit"].items() if get_strategy(s).shards_table]


def _from_results(folder: Path) -> str:
    """The folder from its ``results/`` on (where it lies in whichever checkout ran this)."""
    parts = folder.resolve().parts
    return str(Path(*parts[parts.index("results"):])) if "results" in parts else str(folder)


def analyse(folders: Sequence[Path], data: Path, steps: int) -> Dict[str, Any]:
    from embrace_fairseq.perf.bench.report import _by_key, dependency_limit  # noqa: PLC2701
    from embrace_fairseq.perf.strategies import FLOOR

    source = source_state()  # before the timing: the tree it timed
    results = [(f, json.loads((f / "bench.json").read_text())) for f in folders]
    stretches: Dict[str, Dict[str, float]] = {}
    for _, r in results:
        for run in r["runs"]:
            if run["model"] not in stretches:
                print(f"[dependency limit] timing {run['model']}'s output stretch ...", flush=True)
                stretches[run["model"]] = time_stretch_apart(run["model"], run["world_size"], data, steps)
    runs: List[Dict[str, Any]] = []
    for folder, r in results:
        by = _by_key(r["runs"])
        for key, cal in (r.get("regimes") or {}).items():
            per = {s: x for (k, s), x in by.items() if k == key}
            plain = cal.get("limit")
            if FLOOR not in per or not plain:
                continue
            model = per[FLOOR]["model"]
            dep = dependency_limit(per, per[FLOOR], stretches[model]["share"], r["profiles"][model]["dense_numel"],
                                   plain["min_bytes"])
            runs.append({"folder": _from_results(folder), "run": key, "commit": (r["meta"].get("source") or {}).get("commit"),
                         "plain_limit_s": plain["limit_s"], "dependency_limit": dep,
                         "embrace": _embrace_rows(key, dep, plain)})
    return {"source": source, "stretches": stretches, "runs": runs}


def markdown(res: Dict[str, Any]) -> str:
    from embrace_fairseq.perf.strategies import get_strategy

    src = res["source"]
    L = ["# The dependency-aware limit of the regime runs", "",
         f"Stretches timed on commit `{src['commit']}`" + (" with uncommitted changes" if src.get("dirty") else "")
         + " (`python -m embrace_fairseq.perf.bench.dependency_limit`); each run's steps are its own "
         "(its commit below).", "",
         "The output stretch is the part of a step in which no dense gradient can be on the link, whatever the "
         "order: from the last dense layer's forward to the loss, and from the backward's start to the first "
         "dense gradient, less the table gradient's product (no dense layer waits for it), timed on the stock "
         "model in one process as a share of its step (`perf/bench/stretch.py`). Dependency-aware limit = "
         "max(floor, least bytes / link, stretch + dense bytes / link), per floor step. Ratios: geometric "
         "means of the paired steps, 95 % Student t intervals.", "",
         "Allocator of the timing: " + ", ".join(sorted({s.get("allocator", "?") for s in res["stretches"].values()}))
         + " (as the bench ranks).", "",
         "| workload | output forward s | output backward s | table gradient s | stretch s | share of the step |",
         "|---|---|---|---|---|---|"]
    for m, s in res["stretches"].items():
        L.append(f"| {m} | {s['forward_s']:.3f} | {s['backward_s']:.3f} | {s['table_grad_s']:.3f} | "
                 f"{s['stretch_s']:.3f} | {100 * s['share']:.1f} % |")
    L += ["", "| run | limit s | stretch s + dense s | dependency-aware limit s | strategy | step / limit | "
          "step / dependency-aware limit | commit |", "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        d = r["dependency_limit"]
        for e in r["embrace"]:
            a, b = e["over_limit"], e["over_dependency_limit"]
            L.append(f"| {r['run']} | {r['plain_limit_s']:.3f} | {d['stretch_s']:.3f} + {d['dense_over_link_s']:.3f} | "
                     f"{d['limit_s']:.3f} | {get_strategy(e['strategy']).label} | "
                     f"{a['ratio']:.2f} [{a['low']:.2f}, {a['high']:.2f}] | {b['ratio']:.2f} [{b['low']:.2f}, {b['high']:.2f}] | "
                     f"{(r['commit'] or '?')[:7]} |")
    return "\n".join(L) + "\n"


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", type=Path, help="regime run folders (each with a bench.json)")
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--steps", type=int, default=5, help="timed steps per workload (their median; default 5)")
    p.add_argument("--out", type=Path, help="folder for dependency_limit.json and .md")
    p.add_argument("--time-one", metavar="MODEL", help=argparse.SUPPRESS)  # one workload's stretch, as JSON
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.time_one:
        print(json.dumps(time_stretch(a.time_one, a.world, a.data, a.steps)))
        return 0
    if a.out is None or not a.folders:
        p.error("give the run folders and --out")
    res = analyse(a.folders, a.data, a.steps)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "dependency_limit.json").write_text(json.dumps(res, indent=1))
    (a.out / "dependency_limit.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
