"""What the machine lets any schedule reach: the schedule's step goals against the cores.

Every variant of the schedule's ablation does the same work: the same compute and the
same bytes through the same collectives, only ordered differently. Where the ranks share
``C`` cores (4 ranks on 2 cores here) and their communication runs on those cores too
(gloo reduces and copies on the CPU; the kernel moves the bytes), no step of that work can
be shorter than its CPU seconds (every rank, every thread) over ``C``: the *CPU bound*.
Ordering collectives can fill idle cores, never make the work smaller.

How close a step comes to its own bound is its *efficiency* (mean step / bound, at
least 1). The compute-only floor, with no communication and no peer to wait for but the
end-of-step barrier, shows the best efficiency the ranks reach on this machine, in the same
rounds as the variants (so under the same load of other processes).

A goal asks for a step no longer than a target (FIFO overlap's step / 1.15; the floor's
step x 1.15), so it needs the efficiency ``target / bound``, with the bound the least CPU
the same work took in the run. The report judges a speed-up on its interval's lower end,
so "as judged" the point ratio over FIFO must be 1.15 plus the reach of the interval
below its point (the narrowest of the run's variants): FIFO's step / (1.15 + reach).
Verdicts:

* ``"impossible"``: the target is shorter than the CPU work itself (need < 1);
* ``"beyond the floor"``: reaching it would mean keeping the cores busier than the ranks
  do with no communication at all (need below the lower end of the floor's efficiency
  interval);
* ``"room"``: otherwise (an order of collectives could reach it; nothing says one does).

>>> runs = {"fifo": {"step_s": [1.1] * 4, "cpu_s": [2.0] * 4},
...         "sched": {"step_s": [1.05] * 4, "cpu_s": [1.9] * 4},
...         "floor": {"step_s": [0.8] * 4, "cpu_s": [1.5] * 4}}
>>> lim = machine_limits(runs, cores=2, same_work=("fifo", "sched"), base="fifo", floor="floor")
>>> round(lim["bound_s"], 2), round(lim["floor_efficiency"]["ratio"], 3)
(0.95, 1.067)
>>> lim["goals"]["over_fifo"]["verdict"], round(lim["goals"]["over_fifo"]["need"], 3)
('beyond the floor', 1.007)
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from embrace_fairseq.perf.bench.stats import RATIO_STATISTIC, STATISTICS, paired_ratio_interval, ratio_of

#: the full schedule's step against FIFO overlap with the backward: at least this much faster
OVER_FIFO = 1.15
#: the full schedule's step against the compute-only floor: at most this much slower
OVER_FLOOR = 1.15

IMPOSSIBLE, BEYOND_FLOOR, ROOM = "impossible", "beyond the floor", "room"


def _cpu_steps(run: Mapping[str, Any]) -> Optional[Sequence[float]]:
    """CPU seconds of every rank per timed step (older results hold only their mean)."""
    if run.get("cpu_s"):
        return run["cpu_s"]
    if run.get("cpu_s_per_step") is not None:
        return [run["cpu_s_per_step"]] * len(run["step_s"])
    return None


def _bound_steps(run: Mapping[str, Any], cores: int) -> Sequence[float]:
    """Each timed step's CPU bound: its CPU seconds over the cores."""
    return [c / cores for c in _cpu_steps(run)]


def efficiency(run: Mapping[str, Any], cores: int, statistic: str = RATIO_STATISTIC) -> Optional[Dict[str, float]]:
    """A run's step over its CPU bound (CPU seconds per step / ``cores``; ``statistic``
    of each over the timed steps), with the paired-bootstrap interval over its steps;
    None without CPU times."""
    if _cpu_steps(run) is None:
        return None
    return paired_ratio_interval(run["step_s"], _bound_steps(run, cores), statistic=statistic)


def verdict(need: float, floor_low: float) -> str:
    """:data:`IMPOSSIBLE`, :data:`BEYOND_FLOOR` or :data:`ROOM` for an efficiency
    ``need`` given the lower end of the floor's efficiency interval."""
    if need < 1.0:
        return IMPOSSIBLE
    if need < floor_low:
        return BEYOND_FLOOR
    return ROOM


def machine_limits(runs: Mapping[str, Mapping[str, Any]], cores: int, same_work: Sequence[str], base: str,
                   floor: str, statistic: str = RATIO_STATISTIC) -> Optional[Dict[str, Any]]:
    """The step goals of one run key against what its cores allow.

    ``runs``: strategy name -> run record (``step_s``, ``cpu_s`` or ``cpu_s_per_step``);
    ``same_work``: the variants that do the same work (the ablation's); ``base``: FIFO
    overlap; ``floor``: the compute-only floor; ``statistic``: how steps and CPU times
    are summarised over the timed steps. None when the base, the floor or their CPU
    times are missing."""
    if base not in runs or floor not in runs or cores < 1:
        return None
    work = {s: runs[s] for s in same_work if s in runs and _cpu_steps(runs[s]) is not None}
    floor_eff = efficiency(runs[floor], cores, statistic)
    if base not in work or floor_eff is None:
        return None
    summary = STATISTICS[statistic]
    cpu = {s: summary(_cpu_steps(r)) for s, r in work.items()}
    least = min(cpu, key=cpu.get)
    bound = cpu[least] / cores  # the least CPU the same work took in this run
    effs = {s: ratio_of(r["step_s"], _bound_steps(r, cores), statistic) for s, r in work.items()}
    best = min(effs, key=effs.get)
    # the report judges the speed-up on its interval's lower end: with these steps' noise the
    # point ratio must clear 1.15 by the interval's reach below it (the narrowest of the run)
    intervals = [paired_ratio_interval(runs[base]["step_s"], r["step_s"], statistic=statistic)
                 for s, r in work.items() if s != base]
    reach = min((iv["ratio"] - iv["low"] for iv in intervals), default=0.0)
    targets = {"over_fifo": summary(runs[base]["step_s"]) / OVER_FIFO,
               "over_fifo_as_judged": summary(runs[base]["step_s"]) / (OVER_FIFO + reach),
               "over_floor": summary(runs[floor]["step_s"]) * OVER_FLOOR}
    goals = {name: {"target_s": t, "need": t / bound, "verdict": verdict(t / bound, floor_eff["low"])}
             for name, t in targets.items()}
    return {"cores": cores, "bound_s": bound, "bound_from": least, "floor_efficiency": floor_eff, "reach": reach,
            "best_efficiency": {"strategy": best, "ratio": effs[best]}, "efficiency": effs, "goals": goals}


def cores_of(meta: Mapping[str, Any]) -> int:
    """The cores the ranks shared, from a result's ``meta`` (0 when not recorded)."""
    machine = meta.get("machine") or {}
    return int(machine.get("cpus") or 0) if isinstance(machine, Mapping) else 0

