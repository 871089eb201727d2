"""``python -m embrace_fairseq.perf.bench [--quick] [--out results/bench/<mode>]``

Runs data-parallel strategies side by side on an emulated cluster (one network
namespace per rank or per node, rate-limited veth links; :mod:`.netem_cluster`), for
the chosen models, rank counts and link speeds (strategies and link speeds interleaved
round by round), and writes ``bench.json``, ``report.md`` and plots to the output
folder. Quick mode: 2 and 4 ranks, 1 Gbit/s, every strategy, smaller LMs. Full mode
(the default): the main models on 4 ranks at 1, 2.5 and 10 Gbit/s against the tuned
baselines and the floor; ``scripts/bench_full.sh`` adds the IWSLT-shaped model and 8
ranks and summarises all runs. ``--cleanup`` removes namespaces a killed run left
behind. Without namespaces (no root, no iproute2) it runs on loopback and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.guards import one_line_errors
from embrace_fairseq.perf.strategies import FLOOR, STRATEGIES, canonical_strategy, get_strategy
from embrace_fairseq.perf.bench import memory_guard as MG
from embrace_fairseq.perf.bench import netem_cluster as NC
from embrace_fairseq.perf.bench.allocator import ALLOCATORS
from embrace_fairseq.perf.bench.regime_goals import MIN_STEPS

REPO_ROOT = Path(__file__).resolve().parents[3]
#: the full run's strategies: every stock baseline as its users tune it (fairseq's default
#: backend c10d, DeepSpeed ZeRO-0/1/2, sparse all-gather), EmbRace at ZeRO-0 (the 2D
#: schedule) and at ZeRO-1, and the compute-only floor
FULL_STRATEGIES = ("fairseq_c10d", "deepspeed", "deepspeed_zero1", "deepspeed_zero2", "sparse_allgather",
                   "sparse_allgather_overlap",
                   "embrace_schedule", "embrace_zero1", "compute_floor")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embrace_fairseq.perf.bench", description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="2 and 4 ranks, 1 Gbit/s, fewer steps, smaller LM")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/bench/<quick|full>)")
    p.add_argument("--models", default=None,
                   help="comma list of: lm (untied LM), translation (main-job model, tied), gpt_lm (tied GPT-style "
                        "LM, 32k BPE), iwslt (transformer_iwslt_de_en, decoder tied) (default lm,translation quick; "
                        "translation,gpt_lm,lm full)")
    p.add_argument("--worlds", default=None, help="comma list of rank counts (default 2,4 quick; 4 full)")
    p.add_argument("--gbit", default=None,
                   help="comma list of link rates in Gbit/s, interleaved round by round (default 1 quick, 1,2.5,10 full)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks per emulated node: the ranks of a node share its namespace (fast link), nodes are "
                        "joined by the shaped links (default 1: every rank a node of its own)")
    p.add_argument("--latency-ms", type=float, default=0.1, help="one-way rank-to-rank latency (needs sch_netem)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps-per-round", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per strategy at least, before the timed ones (default 1 quick, 2 full)")
    p.add_argument("--max-warmup", type=int, default=6,
                   help="untimed steps per strategy at most: after --warmup, more until two in a row agree within "
                        "15 %% (steady state), up to this many (default %(default)s)")
    p.add_argument("--strategies", default=None,
                   help="comma list of strategies (default: every one quick; the baselines, EmbRace at ZeRO-0 and "
                        "ZeRO-1 and the floor full)")
    p.add_argument("--loopback", action="store_true", help="do not create namespaces: all ranks on loopback")
    p.add_argument("--data", type=Path, default=REPO_ROOT / "data")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per launch of the ranks")
    p.add_argument("--cleanup", action="store_true", help="remove leftover namespaces of killed runs and exit")
    p.add_argument("--regime", default=None,
                   help="comma list of compute-matched regimes (v100-25g, a100-100g): instead of --gbit, each model's "
                        "link is set so that c10d's communication over the measured compute-only step equals the "
                        "released model's on that GPU and network (the floor is timed in the same launch; "
                        "compute_floor is added to the strategies)")
    p.add_argument("--calibration-steps", type=int, default=3,
                   help="compute-only floor steps timed for a regime's calibration (their median; default 3)")
    p.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                   help="the ranks' memory allocator: jemalloc keeping freed pages, as a GPU's caching allocator "
                        "does (auto: where installed), or glibc's, which faults large blocks in again every step")
    p.add_argument("--memory-reserve-gb", type=float, default=MG.DEFAULT_RESERVE_GB,
                   help="stop every rank, naming what each held, once the machine has less memory than this "
                        "available (default %(default)s; 0: no guard, the kernel's OOM killer decides)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin rank r to core r %% (cores this process may use): ranks with a core each")
    a = p.parse_args(argv)
    mode = "quick" if a.quick else "full"
    a.mode = mode
    if a.regime is not None and a.gbit is not None:
        p.error("--regime sets the links itself: give it or --gbit, not both")
    a.out = a.out or REPO_ROOT / "results" / "bench" / mode
    a.gbit = [float(x) for x in (a.gbit or ("1" if a.quick else "1,2.5,10")).split(",")]
    a.rounds = a.rounds or (2 if a.quick else 4)
    a.steps_per_round = a.steps_per_round or (4 if a.quick else 3)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if a.rounds * a.steps_per_round < MIN_STEPS:
        print(f"[bench] note: {a.rounds} rounds x {a.steps_per_round} steps = {a.rounds * a.steps_per_round} timed steps "
              f"per strategy; the goals give no verdict on fewer than {MIN_STEPS}", file=sys.stderr)
    a.models = [m for m in (a.models or ("lm,translation" if a.quick else "translation,gpt_lm,lm")).split(",") if m]
    a.worlds = [int(x) for x in (a.worlds or ("2,4" if a.quick else "4")).split(",")]
    a.strategies = a.strategies or ",".join(STRATEGIES if a.quick else FULL_STRATEGIES)
    uneven = [w for w in a.worlds if a.ranks_per_node < 1 or w % a.ranks_per_node]
    if uneven:
        p.error(f"--ranks-per-node {a.ranks_per_node} does not divide the rank counts {uneven}")
    try:
        a.strategies = [canonical_strategy(s) for s in a.strategies.split(",") if s]
    except ValueError as exc:
        p.error(str(exc))
    a.regimes = _regimes(p, a)
    planned = [s for s in a.strategies if get_strategy(s).planned]
    if planned and len(a.regimes or a.gbit) > 1:
        # a plan is fixed for the run (a new one needs a restart), so it holds for one link
        p.error(f"{', '.join(planned)} plans once, on the link it starts on: give one --regime or one --gbit per "
                "run (scripts/bench_regime.sh runs each regime on its own)")
    if a.calibration_steps < 1:
        p.error(f"--calibration-steps must be at least 1, got {a.calibration_steps}")
    return a


def _regimes(p: argparse.ArgumentParser, a: argparse.Namespace) -> List[str]:
    """The regimes asked for, checked: each known, each model standing for a real one; the
    floor joins the strategies (the calibration and the limit need it)."""
    if a.regime is None:
        return []
    from embrace_fairseq.perf.simulator.real_models import real_model_of
    from embrace_fairseq.perf.simulator.regimes import get_regime

    try:
        names = [get_regime(r).name for r in a.regime.split(",") if r.strip()]
        for m in a.models:
            real_model_of(m)
    except ValueError as exc:
        p.error(str(exc))
    if not names:
        p.error("--regime needs at least one regime name")
    if FLOOR not in a.strategies:
        a.strategies.append(FLOOR)
    return names


def _launch(a: argparse.Namespace, model: str, cluster: NC.Cluster, links: List[NC.LinkSpec], tmp: Path,
            log_dir: Path) -> List[Dict[str, Any]]:
    """Start the ranks of one (model, world) in their namespaces; wait; return their results."""
    spec = {
        "model": model, "quick": a.quick, "data": str(a.data), "cache": str(a.cache), "out": str(a.out),
        "tmp": str(tmp), "warmup": a.warmup, "max_warmup": a.max_warmup, "rounds": a.rounds, "steps_per_round": a.steps_per_round,
        "strategies": a.strategies, "links": [{"gbit": l.gbit, "latency_ms": l.latency_ms} for l in links],
        "loopback": cluster.loopback, "cluster": {"tag": cluster.tag, "switch_ns": cluster.switch_ns},
        "placement": [{"rank": p.rank, "netns": p.netns, "ifname": p.ifname, "addr": p.addr, "node": p.node}
                      for p in cluster.ranks],
        "ranks_per_node": cluster.ranks_per_node,
        "pg_timeout_s": 600, "profile_steps": 5,
        "regimes": a.regimes, "calibration_steps": a.calibration_steps,
        "latency_applied": (not cluster.loopback) and NC.netem_available(),
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    master = cluster.ranks[0].addr
    port = 29500 if not cluster.loopback else _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", MASTER_ADDR=master,
               MASTER_PORT=str(port), WORLD_SIZE=str(cluster.world_size), PYTHONWARNINGS="ignore",
               TORCH_CPP_LOG_LEVEL="ERROR")
    env.update(a.allocator_env)
    # the launcher's view of the nodes, as torchrun gives it: what the exchange reads
    k = cluster.ranks_per_node
    env.update(LOCAL_SIZE=str(k), LOCAL_WORLD_SIZE=str(k))
    procs = []
    logs = []
    for p in cluster.ranks:
        e = dict(env, RANK=str(p.rank), LOCAL_RANK=str(p.rank % k), GLOO_SOCKET_IFNAME=p.ifname)
        log = open(log_dir / f"{model}_w{cluster.world_size}_rank{p.rank}.log", "w")
        logs.append(log)
        cmd = p.command_prefix() + [sys.executable, "-m", "embrace_fairseq.perf.bench.worker", str(spec_path)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                      start_new_session=True, preexec_fn=_pinned(a, p.rank)))
    deadline = time.monotonic() + a.timeout
    first_failed: Optional[int] = None
    try:
        while any(pr.poll() is None for pr in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} on {cluster.world_size} ranks: no result within {a.timeout:.0f}s")
            available, total = MG.machine_memory()
            if MG.below_reserve(available, a.memory_reserve_gb):
                held = [MG.resident_bytes(pr.pid) for pr in procs]
                raise RuntimeError(MG.out_of_memory_message(model, cluster.world_size, available, total, held,
                                                            a.memory_reserve_gb))
            failed = [i for i, pr in enumerate(procs) if pr.poll() not in (None, 0)]
            if failed:
                first_failed = failed[0]
                time.sleep(3)  # give the others a moment to report
                break
            time.sleep(0.1)
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        for log in logs:
            log.close()
    results = []
    # the rank that failed first is the cause; the others were stopped above
    order = ([first_failed] if first_failed is not None else []) + [r for r in range(len(procs)) if r != first_failed]
    for p in (cluster.ranks[r] for r in order):
        f = tmp / f"rank{p.rank}.json"
        res = json.loads(f.read_text()) if f.exists() else {"ok": False, "error": _no_result(procs[p.rank].returncode)}
        if not res.get("ok"):
            tail = (log_dir / f"{model}_w{cluster.world_size}_rank{p.rank}.log").read_text()[-3000:]
            raise RuntimeError(f"{model} rank {p.rank} of {cluster.world_size} failed: {res.get('error')}\n{tail}")
        results.append(res)
    return results


def _no_result(returncode: Optional[int]) -> str:
    """Why a rank left no result file, from its exit status.

    >>> print(_no_result(-9))
    no result file: killed by SIGKILL (on Linux, usually the kernel's OOM killer: see dmesg)
    >>> print(_no_result(1))
    no result file: exit status 1
    """
    if returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode).name
        why = " (on Linux, usually the kernel's OOM killer: see dmesg)" if sig == "SIGKILL" else ""
        return f"no result file: killed by {sig}{why}"
    return f"no result file: exit status {returncode}"


def pinned_core(rank: int, cores: List[int]) -> int:
    """The core rank ``rank`` runs on under ``--pin-cores``: ``cores[rank % len(cores)]``.

    >>> pinned_core(0, [0, 1]), pinned_core(3, [0, 1]), pinned_core(2, [4, 5, 6])
    (0, 1, 6)
    """
    return cores[rank % len(cores)]


def _pinned(a: argparse.Namespace, rank: int):
    """With ``--pin-cores``: set the rank's affinity in the child before it runs anything
    (every thread it starts inherits it); else nothing."""
    if not a.pin_cores:
        return None
    core = pinned_core(rank, sorted(os.sched_getaffinity(0)))
    return lambda: os.sched_setaffinity(0, {core})


def _free_port() -> int:
    from embrace_fairseq.core.process_group import free_port

    return free_port()


def _versions() -> Dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "fairseq-fixed", "deepspeed"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


class BenchOptionError(UserError, ValueError):
    """A benchmark option this machine cannot run (e.g. an allocator it does not have)."""


@one_line_errors.command
def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if a.cleanup:
        gone = NC.cleanup_leftovers()
        print(f"removed {len(gone)} namespace(s): {' '.join(gone) or '-'}")
        return 0
    from embrace_fairseq.perf.bench.workloads import (
        build_task_and_batches,
        prepare_shared_inputs,
        workloads,
    )

    t_start = time.time()
    from embrace_fairseq.perf.bench.allocator import allocator_env

    try:
        a.allocator_env, allocator = allocator_env(a.allocator, os.environ)
    except ValueError as exc:
        raise BenchOptionError(str(exc)) from None
    print(f"[bench] allocator: {allocator}", flush=True)
    from embrace_fairseq.perf.provenance import source_state

    source = source_state(REPO_ROOT)  # now: the ranks import the tree as it is when they start
    why_not = "--loopback given" if a.loopback else NC.namespaces_available()
    loopback = why_not is not None
    if loopback:
        print(f"[bench] FALLBACK: ranks on loopback, no emulated links ({why_not}); "
              "communication costs almost nothing here, so the figures do not show link-bound speed", flush=True)
    else:
        per = "rank" if a.ranks_per_node == 1 else f"node of {a.ranks_per_node} ranks"
        print(f"[bench] emulated cluster: one namespace per {per}, tbf rate limit per direction"
              f"{'' if NC.netem_available() else ' (no sch_netem in this kernel: latency not applied)'}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    for sub in ("traces", "logs"):
        shutil.rmtree(a.out / sub, ignore_errors=True)
        (a.out / sub).mkdir()
    a.cache = Path(tempfile.gettempdir()) / "embrace_bench_cache"
    # shared inputs once, before the ranks start (they read the cache)
    prepare_shared_inputs(a.models, a.data, a.cache)
    # regimes: the cluster starts at the first regime's nominal rate; the ranks calibrate
    # the links after their warm-up and report them
    from embrace_fairseq.perf.simulator.regimes import get_regime

    links = ([NC.LinkSpec(get_regime(a.regimes[0]).gbit_per_gpu, 0.0)] if a.regimes
             else [NC.LinkSpec(g, a.latency_ms) for g in a.gbit])
    raw: List[Dict[str, Any]] = []
    for model in a.models:
        for world in a.worlds:
            t0 = time.time()
            named = f"regimes {', '.join(a.regimes)}" if a.regimes else f"links {', '.join(l.label() for l in links)}"
            print(f"[bench] {model}: {world} ranks, {named} ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="embrace_bench_") as tmp:
                cluster = NC.Cluster.create(world, links[0], loopback=loopback, ranks_per_node=a.ranks_per_node)
                try:
                    try:
                        ranks = _launch(a, model, cluster, links, Path(tmp), a.out / "logs")
                    except RuntimeError as exc:  # a rank failed, the memory ran low, or time ran out
                        print(f"[bench] stopped: {exc}", file=sys.stderr, flush=True)
                        return 1
                    raw.append({"model": model, "world_size": world, "cluster": cluster.describe(), "ranks": ranks})
                    if a.regimes:
                        raw[-1]["calibration"] = ranks[0]["calibration"]
                        for c in ranks[0]["calibration"]:
                            print(f"[bench] {model}/w{world}/{c['regime']}: c10d/floor {c['ratio']:.3f} of "
                                  f"{c['real_model']}, floor {c['floor_s']:.3f} s, scale {c['scale']:.1f}, link "
                                  f"{c['gbit']:.3g} Gbit/s, latency {c['latency_ms']:.3g} ms "
                                  f"({'applied' if c['latency_applied'] else 'not applied'})", flush=True)
                finally:
                    cluster.close()
            print(f"[bench] {model}: {world} ranks done in {time.time() - t0:.0f}s", flush=True)
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from embrace_fairseq.perf.bench.report import assemble, write_outputs

    meta = {
        "mode": a.mode, "command": "python -m embrace_fairseq.perf.bench " + " ".join(argv if argv is not None
                                                                                     else sys.argv[1:]),
        "source": source,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_at_start": os.getloadavg()},
        "versions": _versions(), "fallback_loopback": loopback, "fallback_reason": why_not,
        "topology": {"ranks_per_node": a.ranks_per_node},
        "allocator": allocator,
        # --pin-cores: rank r on core r % the cores; the cores each rank could run on, as it saw them
        "pin_cores": a.pin_cores,
        "rank_cores": {f"{launch['model']}/w{launch['world_size']}": {str(rk["rank"]): rk.get("cores")
                                                                     for rk in launch["ranks"]} for launch in raw},
        "regimes": ({"names": a.regimes, "calibration_steps": a.calibration_steps} if a.regimes else None),
        "latency_applied": (not loopback) and NC.netem_available(),
        # regimes: each run's link and latency are its calibration's (result["regimes"])
        "link": {"gbit": [] if a.regimes else a.gbit, "latency_ms": None if a.regimes else a.latency_ms,
                 "shaping": "loopback" if loopback else ("tbf + netem" if NC.netem_available() else "tbf only")},
        "schedule": {"warmup": a.warmup, "max_warmup": a.max_warmup, "rounds": a.rounds,
                     "steps_per_round": a.steps_per_round, "timed_steps": a.rounds * a.steps_per_round,
                     "citable": a.rounds * a.steps_per_round >= MIN_STEPS,
                     "warmup_rule": "each strategy: at least warmup untimed steps, then more until two in a row agree "
                                    "within 15 % (at most max_warmup)",
                     "interleaving": "every round visits every link speed and on it every strategy for steps_per_round "
                                     "steps; both orders rotated each round"},
        "threads_per_rank": 1, "wall_s": None,
    }
    batches = {(r["model"], r["world_size"]): build_task_and_batches(workloads(a.quick)[r["model"]], r["world_size"],
                                                                      a.data, a.cache) for r in raw}
    result = assemble(meta, raw, batches, a.quick)
    result["meta"]["wall_s"] = time.time() - t_start
    paths = write_outputs(result, a.out)
    print(f"[bench] wrote {', '.join(str(p) for p in paths)} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
