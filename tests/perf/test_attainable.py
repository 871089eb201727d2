"""The schedule's step goals against the cores: hand-made runs, figures checked by hand."""
import json

import statistics

import pytest

from embrace_fairseq.perf.bench.attainable import BEYOND_FLOOR, IMPOSSIBLE, ROOM, cores_of, machine_limits, verdict
from embrace_fairseq.perf.bench.report import ABLATION, ABLATION_BASE, FLOOR, attainable_check


def _run(step, cpu, n=8, **extra):
    return {"step_s": [step] * n, "cpu_s": [cpu] * n, **extra}


def test_verdicts_split_at_one_and_at_the_floor():
    assert verdict(0.99, 1.05) == IMPOSSIBLE
    assert verdict(1.02, 1.05) == BEYOND_FLOOR
    assert verdict(1.05, 1.05) == ROOM


def test_bound_is_the_least_cpu_of_the_same_work_and_needs_follow_from_it():
    runs = {"fifo": _run(1.2, 2.0), "sched": _run(1.0, 1.6), "floor": _run(0.8, 1.5),
            "stock": _run(0.5, 0.4)}  # other work: not part of the bound however little CPU it took
    lim = machine_limits(runs, cores=2, same_work=("fifo", "sched"), base="fifo", floor="floor")
    assert lim["bound_s"] == pytest.approx(0.8) and lim["bound_from"] == "sched"
    assert lim["efficiency"] == {"fifo": pytest.approx(1.2), "sched": pytest.approx(1.25)}
    assert lim["best_efficiency"] == {"strategy": "fifo", "ratio": pytest.approx(1.2)}
    assert lim["floor_efficiency"]["ratio"] == pytest.approx(0.8 / 0.75)
    over_fifo, over_floor = lim["goals"]["over_fifo"], lim["goals"]["over_floor"]
    assert over_fifo["target_s"] == pytest.approx(1.2 / 1.15)
    assert over_fifo["need"] == pytest.approx(1.2 / 1.15 / 0.8) and over_fifo["verdict"] == ROOM
    assert over_floor["target_s"] == pytest.approx(0.8 * 1.15)
    assert over_floor["need"] == pytest.approx(0.92 / 0.8) and over_floor["verdict"] == ROOM
    # steps without noise: the interval has no reach below its point, so as judged = the point goal
    assert lim["reach"] == 0.0 and lim["goals"]["over_fifo_as_judged"]["need"] == pytest.approx(over_fifo["need"])


def test_as_judged_the_point_ratio_must_clear_the_goal_by_the_intervals_reach():
    noisy = [1.0, 1.4, 1.0, 1.4, 1.2, 1.2, 1.0, 1.4]  # mean 1.2
    runs = {"fifo": {"step_s": noisy, "cpu_s": [2.0] * 8}, "sched": _run(1.0, 1.6), "floor": _run(0.8, 1.5)}
    lim = machine_limits(runs, cores=2, same_work=("fifo", "sched"), base="fifo", floor="floor")
    assert 0.0 < lim["reach"] < 0.2  # FIFO / sched = 1.2, its interval's lower end below it
    judged = lim["goals"]["over_fifo_as_judged"]
    # the run's statistic: the geometric mean of the steps (of the paired ratios over sched's 1.0 s)
    assert judged["target_s"] == pytest.approx(statistics.geometric_mean(noisy) / (1.15 + lim["reach"]))
    assert judged["need"] < lim["goals"]["over_fifo"]["need"]


def test_a_target_under_the_cpu_work_is_impossible_and_one_under_the_floor_beyond_it():
    runs = {"fifo": _run(1.0, 1.9), "floor": _run(0.8, 1.4)}  # floor efficiency 0.8 / 0.7 = 1.14
    lim = machine_limits(runs, cores=2, same_work=("fifo",), base="fifo", floor="floor")
    assert lim["goals"]["over_fifo"]["need"] == pytest.approx(1.0 / 1.15 / 0.95)  # 0.915
    assert lim["goals"]["over_fifo"]["verdict"] == IMPOSSIBLE
    runs["fifo"] = _run(1.2, 2.0)  # need 1.2 / 1.15 / 1.0 = 1.043, under the floor's 1.14
    lim = machine_limits(runs, cores=2, same_work=("fifo",), base="fifo", floor="floor")
    assert lim["goals"]["over_fifo"]["verdict"] == BEYOND_FLOOR


def test_nothing_without_the_base_the_floor_or_cpu_times():
    fifo, floor = _run(1.0, 1.9), _run(0.8, 1.4)
    assert machine_limits({"floor": floor}, 2, ("fifo",), "fifo", "floor") is None
    assert machine_limits({"fifo": fifo}, 2, ("fifo",), "fifo", "floor") is None
    assert machine_limits({"fifo": {"step_s": [1.0]}, "floor": floor}, 2, ("fifo",), "fifo", "floor") is None
    # older results hold only the mean CPU time per step: used for every step
    lim = machine_limits({"fifo": {"step_s": [1.0, 1.2], "cpu_s_per_step": 2.0}, "floor": floor}, 2, ("fifo",),
                         "fifo", "floor")
    assert lim["efficiency"]["fifo"] == pytest.approx((1.0 * 1.2) ** 0.5)  # geometric mean of 1.0 and 1.2


def test_cores_come_from_the_results_meta():
    assert cores_of({"machine": {"cpus": 2}}) == 2 and cores_of({}) == 0


def test_report_checks_every_run_key_with_fifo_and_the_floor():
    def rec(model, strategy, step, cpu):
        return {"model": model, "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": strategy,
                **_run(step, cpu)}
    runs = [rec("lm", ABLATION_BASE, 1.0, 1.6), rec("lm", ABLATION[-1], 0.9, 1.5), rec("lm", FLOOR, 0.7, 1.3),
            rec("tr", ABLATION_BASE, 1.0, 1.6)]  # no floor: not checked
    out = attainable_check(runs, {"machine": {"cpus": 2}, "ratio_statistic": "mean"})
    assert list(out) == ["lm/w4/1gbit_0.1ms"]
    assert out["lm/w4/1gbit_0.1ms"]["bound_s"] == pytest.approx(0.75)


def test_table_over_several_folders_names_each_run_and_its_commit(tmp_path):
    from embrace_fairseq.perf.bench.attainable_table import main

    def rec(strategy, step, cpu):
        return {"model": "lm", "world_size": 4, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": strategy,
                **_run(step, cpu)}
    for name, commit in (("a", "1234567abc"), ("b", "89abcdef01")):
        (tmp_path / name).mkdir()
        meta = {"machine": {"cpus": 2}, "ratio_statistic": "mean", "source": {"commit": commit}}
        runs = [rec(ABLATION_BASE, 1.0, 1.6), rec(FLOOR, 0.7, 1.3)]
        (tmp_path / name / "bench.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    out = tmp_path / "table.md"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "(commit 1234567)" in text and "(commit 89abcde)" in text
    assert "| a: lm/w4/1gbit_0.1ms | 2 | 0.800 (EmbRace FIFO) |" in text and "| b: lm/w4/1gbit_0.1ms |" in text
