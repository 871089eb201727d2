"""One benchmark rank: builds every strategy once, then runs them interleaved.

Started by :mod:`embrace_fairseq.perf.bench.__main__` inside the rank's network namespace
(``ip netns exec``) with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
``GLOO_SOCKET_IFNAME`` set; ``python -m embrace_fairseq.perf.bench.worker SPEC.json``.

Every strategy takes ``warmup`` steps on the first link, then ``rounds`` rounds: in each,
every link setting in turn (rank 0 reshapes the links between barriers) and on it every
strategy takes ``steps_per_round`` timed steps; both orders rotate each round, so machine
noise and drift hit all strategies and link speeds alike. Each timed step starts after a
barrier.
The rank writes ``rank<N>.json``: per strategy and link the step times, losses, bytes
by kind (EmbRace's ledger; the counted collectives for the stock paths), the bytes
its NIC sent (``tx_bytes`` in its namespace) and, for EmbRace, the trace summary.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce
from embrace_fairseq.perf.bench.stretch import profile_steps
from embrace_fairseq.perf.strategies import FLOOR, REFERENCE, get_strategy


def _tx_bytes(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read().strip())
    except OSError:
        return float("nan")


def _ledger_bytes(snapshot: Dict[str, Dict[str, int]], side: str = "sent") -> Dict[str, float]:
    return {k: float(v) for k, v in snapshot[side].items()}


def _diff(after: Dict[str, float], before: Dict[str, float]) -> Dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)
            if after.get(k, 0.0) - before.get(k, 0.0) != 0}


# stock paths: counted op -> report kind
_STOCK_KINDS = {"all_reduce": "dense_allreduce", "all_gather": "sparse_allgather",
                "sparse_all_reduce": "sparse_allgather", "reduce": "reduce_scatter",
                "all_gather_into_tensor": "param_allgather", "broadcast": "broadcast",
                "all_to_all_single": "alltoall", "reduce_scatter_tensor": "reduce_scatter"}
# EmbRace ledger kind -> report kind
_LEDGER_KINDS = {"dense_grad": "dense_allreduce"}


_T0 = time.time()


def _log(rank: int, msg: str) -> None:
    print(f"[rank {rank} +{time.time() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


def _peak_rss_mb() -> float:
    """This rank's peak resident memory: 8 ranks of a model share the machine's RAM."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _build_all(spec: Dict[str, Any], w: Any, batches: Any, counter: Any,
               names: Optional[List[str]] = None) -> Dict[str, Any]:
    """Every strategy of the spec (or ``names``), built once (EmbRace's with a trace prefix)."""
    built: Dict[str, Any] = {}
    for name in spec["strategies"] if names is None else names:
        strategy = get_strategy(name)
        prefix = str(Path(spec["tmp"]) / f"trace_{name}") if strategy.shards_table or strategy.planned else None
        built[name] = strategy.build(strategy.name, w, batches.task, Path(spec["data"]), counter, trace_prefix=prefix)
    return built


def _set_link(spec: Dict[str, Any], link: Any, rank: int, world: int, initial: bool = False,
              built: Optional[Dict[str, Any]] = None) -> None:
    """Rank 0 reshapes the links between barriers (``initial``: the link the cluster was
    created with, nothing to change); then every strategy of ``built`` learns the new link
    as a job started on it would (untimed; the same order on every rank: the collectives
    pair)."""
    import torch.distributed as dist

    from embrace_fairseq.perf.bench.netem_cluster import Cluster, RankPlacement

    dist.barrier()
    if not initial and rank == 0 and not spec["loopback"]:
        c = Cluster(world, spec["cluster"]["tag"], False, ranks=[RankPlacement(**p) for p in spec["placement"]],
                    switch_ns=spec["cluster"]["switch_ns"], ranks_per_node=spec.get("ranks_per_node", 1))
        c.set_link(link)
    dist.barrier()
    for s in (built or {}).values():
        s.link_changed()


def _timed_steps(spec: Dict[str, Any], s: Any, rec: Dict[str, Any], batches: Any, rank: int, counter: Any,
                 ledger: Any, tx_path: str) -> None:
    """``steps_per_round`` timed steps of one strategy, each after a barrier; its bytes."""
    import torch.distributed as dist

    counter.take()
    counter.tracer = s.own_tracer  # a stock path's collectives on its own timeline
    counter.enabled = True
    snap0 = ledger.snapshot()
    led0, recv0, inter0 = _ledger_bytes(snap0), _ledger_bytes(snap0, "received"), _ledger_bytes(snap0, "inter_node")
    tx0 = _tx_bytes(tx_path)
    for _ in range(spec["steps_per_round"]):
        batch = batches.get(s.steps_done, rank)
        # only the relaxed dependency looks ahead: no other strategy collates a batch it ignores
        upcoming = batches.get(s.steps_done + 1, rank) if s.looks_ahead else None
        rec["batch_steps"].append(s.steps_done)
        rec["tokens"] += int(batch["ntokens"])
        counter.enabled = False
        dist.barrier()
        counter.enabled = True
        t0, c0 = time.perf_counter(), time.process_time()
        loss = s.step(batch, upcoming)
        rec["step_s"].append(time.perf_counter() - t0)
        rec["cpu_s"].append(time.process_time() - c0)
        rec["loss"].append(loss)
        rec["steps"] += 1
    # what the last step left for the next forward is finished now, on this round's clock
    t0, c0 = time.perf_counter(), time.process_time()
    s.settle()
    rec["step_s"][-1] += time.perf_counter() - t0
    rec["cpu_s"][-1] += time.process_time() - c0
    counter.enabled = False
    counter.tracer = None
    rec["wire"] += _tx_bytes(tx_path) - tx0
    snap1 = ledger.snapshot()
    for side, before, into in (("sent", led0, rec["bytes"]), ("received", recv0, rec["received"]),
                               ("inter_node", inter0, rec["inter_node"])):
        for k, v in _diff(_ledger_bytes(snap1, side), before).items():
            k = _LEDGER_KINDS.get(k, k)
            into[k] = into.get(k, 0.0) + v
    for k, v in counter.take_calls().items():
        rec["calls"][k] = rec["calls"].get(k, 0) + v
    for k, v in counter.take().items():
        rec["counted"][k] = rec["counted"].get(k, 0.0) + v


def _on_ledger(name: str, built: Dict[str, Any]) -> bool:
    """Does EmbRace's ledger hold the strategy's bytes (its fixed configurations, and the
    planned one where its plan put it on the EmbRace hook)? Else the counted collectives."""
    spec = get_strategy(name)
    return spec.shards_table or (spec.planned and built[name].hook is not None)


def _entry(spec: Dict[str, Any], name: str, rec: Dict[str, Any], built: Dict[str, Any], link: Any,
           world: int) -> Dict[str, Any]:
    """One strategy's record for one link: per-step means, and the saved trace."""
    n = max(1, rec["steps"])
    if _on_ledger(name, built):  # EmbRace's ledger
        by_kind = {k: v / n for k, v in rec["bytes"].items()}
        if get_strategy(name).dense_by_deepspeed:  # plus what DeepSpeed's ZeRO sent itself
            by_kind.update({k: by_kind.get(k, 0.0) + v / n for k, v in _deepspeed_share(rec).items()})
    else:  # the counted collectives of the stock paths
        by_kind = {}
        for k, v in rec["counted"].items():
            kk = _STOCK_KINDS.get(k, k)
            by_kind[kk] = by_kind.get(kk, 0.0) + v / n
    entry = {"step_s": rec["step_s"], "cpu_s": rec["cpu_s"], "loss": rec["loss"], "bytes_by_kind": by_kind,
             "counted_bytes_by_op": {k: v / n for k, v in rec["counted"].items()},
             # collectives per step by op: the buckets each setting made
             "calls_per_step_by_op": {k: v / n for k, v in rec["calls"].items()},
             "settings": built[name].settings,
             "warmup_step_s": rec.get("warmup_step_s", []),
             "wire_bytes_per_step": None if spec["loopback"] else rec["wire"] / n,
             "tokens": rec["tokens"], "batch_steps": rec["batch_steps"], "rounds": rec["rounds"]}
    if _on_ledger(name, built):  # the exchange's owner side is received in backward
        entry["bytes_received_by_kind"] = {k: v / n for k, v in rec["received"].items()}
        # what left the rank's node (the ledger knows the nodes from the launcher's view)
        entry["inter_node_bytes_by_kind"] = {k: v / n for k, v in rec["inter_node"].items()}
    tracer = built[name].tracer  # EmbRace's hook's, or a stock path's own (not the floor's)
    if tracer is not None:
        # this link's events only: the rounds visit every link, each keeps its own
        tracer.clear()
        tracer.extend(rec["trace_events"])
        summ = tracer.summary()
        entry["trace_summary"] = summ
        entry["hidden_share"] = summ.get("hidden_share")
        tdir = Path(spec["out"]) / "traces" / f"{spec['model']}_w{world}_{link.label()}"
        path = tracer.save(str(tdir / name))
        entry["trace"] = os.path.relpath(path, spec["out"])
        tracer.clear()
    return entry


def _deepspeed_share(rec: Dict[str, Any]) -> Dict[str, float]:
    """The bytes DeepSpeed's own collectives sent (ZeRO's reduction and parameter
    all-gather) under an EmbRace strategy: every counted collective less what EmbRace's
    ledger recorded (both count one rank's bytes by the same ring formulas; EmbRace
    never calls ``all_gather_into_tensor``, so that op is all DeepSpeed's)."""
    counted = sum(rec["counted"].values())
    gather = rec["counted"].get("all_gather_into_tensor", 0.0)
    reduction = counted - gather - sum(rec["bytes"].values())
    return {_STOCK_KINDS["all_gather_into_tensor"]: gather, _STOCK_KINDS["all_reduce"]: max(0.0, reduction)}


def _record() -> Dict[str, Any]:
    return {"step_s": [], "cpu_s": [], "loss": [], "bytes": {}, "received": {}, "inter_node": {}, "counted": {},
            "calls": {}, "wire": 0.0,
            "steps": 0, "batch_steps": [], "tokens": 0, "rounds": [], "trace_events": []}


def _rotated(items: List[Any], r: int) -> List[Any]:
    return items[r % len(items):] + items[:r % len(items)]


def _measure(spec: Dict[str, Any], built: Dict[str, Any], batches: Any, rank: int, counter: Any,
             tx_path: str, links: List[Any], world: int,
             calibration: Optional[List[Dict[str, Any]]] = None,
             build_late: Optional[Callable[[], Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """Warm-up on the first link, then the rounds: in each round every link (order rotated
    each round) and on it every strategy (order rotated each round) takes its timed steps,
    so the machine's drift hits every link and strategy alike. A record per link and
    strategy; the machine's 1-minute load average after every link of every round.
    With regimes in the spec the links are calibrated after the warm-up (:func:`_calibrate`;
    filled into ``calibration``); ``build_late`` builds the strategies that plan on the link
    they are built on (:attr:`~embrace_fairseq.perf.strategies.StrategySpec.planned`) once
    the calibrated link is in place, and they warm up there."""
    from embrace_fairseq.core.ledger import global_ledger
    from embrace_fairseq.perf.bench.netem_cluster import LinkSpec

    calibration = [] if calibration is None else calibration

    _set_link(spec, links[0], rank, world, initial=True)
    _log(rank, f"warm-up on {links[0].label()}")
    warm = {name: _warm_up(spec, built[name], batches, rank) for name in spec["strategies"] if name in built}
    for s in built.values():
        if s.tracer is not None:
            s.tracer.clear()
    if spec.get("regimes"):  # the links come from the floor measured now
        calibration[:] = _calibrate(spec, built, batches, rank, world, counter)
        links = [LinkSpec(gbit=c["gbit"], latency_ms=c["latency_ms"], regime=c["regime"]) for c in calibration]
        _set_link(spec, links[0], rank, world, built=built)
    if build_late is not None:
        late = build_late()
        _log(rank, f"built {', '.join(late)} on {links[0].label()}")
        built.update(late)
        for name, s in late.items():
            warm[name] = _warm_up(spec, s, batches, rank)
            if s.tracer is not None:
                s.tracer.clear()
    _level(built, batches, rank, warm)
    names = list(spec["strategies"])
    per = {(li, n): _record() for li in range(len(links)) for n in names}
    for n in names:
        per[(0, n)]["warmup_step_s"] = warm[n]
    load: Dict[int, List[float]] = {li: [] for li in range(len(links))}
    current = 0
    for r in range(spec["rounds"]):
        for li in _rotated(list(range(len(links))), r):
            if li != current:
                _set_link(spec, links[li], rank, world, built=built)
                current = li
            _log(rank, f"round {r + 1}/{spec['rounds']}, link {links[li].label()} (peak RSS {_peak_rss_mb():.0f} MB)")
            for name in _rotated(names, r):
                rec = per[(li, name)]
                rec["rounds"].extend([r] * spec["steps_per_round"])
                _timed_steps(spec, built[name], rec, batches, rank, counter, global_ledger(), tx_path)
                if built[name].tracer is not None:
                    rec["trace_events"].extend(built[name].tracer.take())
            load[li].append(os.getloadavg()[0])
    return [{"link": l.as_dict(),
             "strategies": {n: _entry(spec, n, per[(li, n)], built, l, world) for n in names},
             "load_1min": load[li]} for li, l in enumerate(links)]


def _warm_up(spec: Dict[str, Any], s: Any, batches: Any, rank: int) -> List[float]:
    """A strategy's untimed steps until its step time is steady: at least ``warmup`` steps,
    then more until the last two agree (:func:`.calibration.is_warm`), at most
    ``max_warmup``. Rank 0 decides, so every rank steps as often (the collectives pair).
    The warm-up steps' times (recorded: a reader sees how the strategy settled)."""
    import torch.distributed as dist

    from embrace_fairseq.core.collectives import all_gather_object
    from embrace_fairseq.perf.bench.calibration import is_warm

    times: List[float] = []
    at_most = max(spec["warmup"], spec.get("max_warmup", spec["warmup"]))
    while len(times) < at_most:
        if len(times) >= spec["warmup"] and all_gather_object(is_warm(times))[0]:
            break
        batch = batches.get(s.steps_done, rank)
        upcoming = batches.get(s.steps_done + 1, rank) if s.looks_ahead else None
        dist.barrier()
        t0 = time.perf_counter()
        s.step(batch, upcoming)
        times.append(time.perf_counter() - t0)
    return times


def _level(built: Dict[str, Any], batches: Any, rank: int, warm: Dict[str, List[float]]) -> None:
    """Untimed steps until every strategy has stepped as often as the one that warmed up
    longest: the timed steps then pair step ``i`` of one strategy with step ``i`` of every
    other on the same batch and from the same weights (the paired ratios and the loss
    check need both). The steps' times join the warm-up's."""
    import torch.distributed as dist

    target = max(s.steps_done for s in built.values())
    for name, s in built.items():
        while s.steps_done < target:
            batch = batches.get(s.steps_done, rank)
            upcoming = batches.get(s.steps_done + 1, rank) if s.looks_ahead else None
            dist.barrier()
            t0 = time.perf_counter()
            s.step(batch, upcoming)
            warm.setdefault(name, []).append(time.perf_counter() - t0)
        s.settle()


def _calibrate(spec: Dict[str, Any], built: Dict[str, Any], batches: Any, rank: int, world: int,
               counter: Any) -> List[Dict[str, Any]]:
    """The regimes' links for this model and world (:mod:`.calibration`): the compute-only
    floor, once warm, timed for a few steps, each between two barriers (so rank 0's clock holds the
    slowest rank's step), rank 0 computes the links, every rank takes rank 0's."""
    import torch.distributed as dist

    from embrace_fairseq.core.collectives import all_gather_object
    from embrace_fairseq.perf.bench import workloads as W
    from embrace_fairseq.perf.bench.calibration import MAX_WARM_STEPS, calibrate, is_warm

    floor = built[FLOOR]
    first = floor.steps_done
    counter.enabled = False

    def timed_floor_step() -> float:
        batch = batches.get(floor.steps_done, rank)
        dist.barrier()
        t0 = time.perf_counter()
        floor.step(batch)
        dist.barrier()
        return time.perf_counter() - t0

    # untimed floor steps until two in a row agree (calibration.is_warm): the warm-up ran every
    # strategy after the floor, so the floor's blocks are not the allocator's to reuse yet (an
    # mBART floor step took 24 s cold and 3.7 s after). Rank 0 decides, so every rank steps
    # (and meets the barriers) as often.
    untimed: List[float] = []
    while len(untimed) < MAX_WARM_STEPS and not all_gather_object(is_warm(untimed))[0]:
        untimed.append(timed_floor_step())
    times = [timed_floor_step() for _ in range(spec.get("calibration_steps", 3))]
    # the timed rounds pair step i of every strategy with batch i: the floor starts them
    # where the others do (it trains on these batches again; its losses are its own anyway)
    floor.steps_done = first
    links: List[Dict[str, Any]] = []
    if rank == 0:
        w = W.workloads(spec["quick"])[spec["model"]]
        params = dict(floor.module.named_parameters())
        tables = [{"vocab": int(params[t].shape[0]), "dim": int(params[t].shape[1])} for t in w.tables]
        dense = int(sum(p.numel() for n, p in params.items() if n not in w.tables))
        links = calibrate(spec["model"], world, times, tables, dense, spec["regimes"], spec["latency_applied"],
                          link_applied=not spec["loopback"], warm_steps_s=untimed)
        _log(rank, "calibrated links: " + ", ".join(f"{c['regime']} {c['gbit']:.3g} Gbit/s" for c in links)
             + f" (floor {statistics.median(times):.3f} s after {len(untimed)} untimed steps)")
    links = all_gather_object(links)[0]
    counter.take()
    return links


def run(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    import embrace_fairseq.fairseq_adapter  # noqa: F401  (archs, CPU fixes)
    from embrace_fairseq.perf.bench import workloads as W
    from embrace_fairseq.perf.bench.comm_count import CollectiveCounter, counting
    from embrace_fairseq.perf.bench.netem_cluster import LinkSpec, RankPlacement

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    skip_shm_allreduce()  # the stock DeepSpeed strategies too
    _log(rank, "imported")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
    w = W.workloads(spec["quick"])[spec["model"]]
    batches = W.build_task_and_batches(w, world, Path(spec["data"]), Path(spec["cache"]))
    counter = CollectiveCounter()
    t_build = time.perf_counter()
    # a planned strategy decides from the link it is built on: in a regime run, the calibrated one
    late = [n for n in spec["strategies"] if spec.get("regimes") and get_strategy(n).planned]
    built = _build_all(spec, w, batches, counter, [n for n in spec["strategies"] if n not in late])
    build_s = time.perf_counter() - t_build
    _log(rank, f"built {len(built)} strategies in {build_s:.0f}s")
    tx_path = RankPlacement(**spec["placement"][rank]).tx_bytes_path()
    results: Dict[str, Any] = {"rank": rank, "world_size": world, "build_s": build_s, "links": [],
                               "cores": sorted(os.sched_getaffinity(0))}
    calibration: List[Dict[str, Any]] = []
    with counting(counter):
        results["links"] = _measure(spec, built, batches, rank, counter, tx_path,
                                    [LinkSpec(**d) for d in spec["links"]], world, calibration,
                                    (lambda: _build_all(spec, w, batches, counter, late)) if late else None)
    if spec.get("regimes"):
        results["calibration"] = calibration
    # compute profile: one process at a time, no communication (rank 0; the others wait)
    dist.barrier()
    if rank == 0:
        results["compute_profile"] = _profile(built, batches, spec, w)
    dist.barrier()
    for s in built.values():
        if s.hook is not None:
            s.hook._closed = True  # traces were saved per link above
    return results


def _profile(built, batches, spec, w) -> Dict[str, Any]:
    """Median forward / backward / optimizer seconds of the stock model alone."""
    from embrace_fairseq.perf.bench import workloads as W

    s = built.get(REFERENCE) or next(iter(built.values()))
    model = s.module
    criterion, opt = s.extra["criterion"], s.extra["optimizer"]
    if s.engine is not None:  # only DeepSpeed strategies built: a local copy of the stock model, its own loss
        model = W.build_model(w, w.stock_arch, batches.task, Path(spec["data"]))
        criterion = W.build_criterion(w, batches.task)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    def loss_of(i: int) -> torch.Tensor:
        loss, ss, _ = criterion(model, batches.get(i, 0))
        return loss / max(1, ss)

    timed = profile_steps(model, w.tables, loss_of, opt, spec["profile_steps"] - 1)
    params = dict(model.named_parameters())
    tables = [{"name": t, "vocab": int(params[t].shape[0]), "dim": int(params[t].shape[1])} for t in w.tables]
    return {
        "compute_s": timed["compute_s"],
        # the output stretch (perf/bench/stretch.py): its share of this step sets the
        # dependency-aware limit of every run of the model
        "stretch": timed["stretch"],
        "dense_layers": W.dense_layers(model, w),
        "dense_numel": int(sum(p.numel() for n, p in params.items() if n not in w.tables)),
        # the tables as one (the simulator's view: all rows sharded, one id space)
        "vocab": sum(t["vocab"] for t in tables),
        "dim": tables[0]["dim"],
        "tables": tables,
    }


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ["RANK"])
    out = Path(spec["tmp"]) / f"rank{rank}.json"
    try:
        res = run(spec)
        res["ok"] = True
    except BaseException as exc:  # report, then fail
        import traceback

        res = {"ok": False, "rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write_text(json.dumps(res))
        print(res["traceback"], file=sys.stderr, flush=True)
        return 1
    out.write_text(json.dumps(res))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
