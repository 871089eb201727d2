"""The full benchmark's one-page summary over several runs: figures checked by hand."""
import json

from embrace_fairseq.perf.bench.summary import main, summarize


def _run(model, n, strategy, steps, over_min=1.0):
    return {"model": model, "world_size": n, "link_gbit": 1.0, "latency_ms": 0.1, "strategy": strategy,
            "step_s": steps, "median_step_s": sorted(steps)[len(steps) // 2], "bytes_over_min": over_min}


def _bench(tmp_path, name, runs, commit, **meta_extra):
    d = tmp_path / name
    d.mkdir()
    meta = {"command": f"bench {name}", "source": {"commit": commit, "dirty": False}, "wall_s": 120.0,
            "machine": {"cpus": 2}, "fallback_loopback": False, **meta_extra}
    (d / "bench.json").write_text(json.dumps({"meta": meta, "profiles": {}, "runs": runs}))
    return d


def test_speedups_of_both_subjects_over_every_stock_baseline(tmp_path):
    a = _bench(tmp_path, "w4", [_run("lm", 4, "fairseq_c10d", [2.0, 2.0, 2.0]),
                                _run("lm", 4, "embrace_schedule", [1.0, 1.0, 1.0]),
                                _run("lm", 4, "embrace_zero1", [0.5, 0.5, 0.5]),
                                _run("lm", 4, "compute_floor", [0.25, 0.25, 0.25])], "a" * 40)
    b = _bench(tmp_path, "w8", [_run("lm", 8, "deepspeed_zero1", [3.0, 3.0]),
                                _run("lm", 8, "embrace_schedule", [2.0, 2.0], over_min=1.2)], "b" * 40)
    s = summarize([a, b])
    got = {(x["world_size"], x["subject"], x["baseline"]): x["ratio"] for x in s["speedups"]}
    # stock baselines only: never the floor, never another EmbRace strategy
    assert got == {(4, "embrace_schedule", "fairseq_c10d"): 2.0, (4, "embrace_zero1", "fairseq_c10d"): 4.0,
                   (8, "embrace_schedule", "deepspeed_zero1"): 1.5}
    assert s["max_half_width"] == 0.0  # identical steps: the interval is the point
    assert s["over_floor"]["lm/w4/1gbit_0.1ms"] == {"fairseq_c10d": 8.0, "embrace_schedule": 4.0, "embrace_zero1": 2.0}
    assert s["bytes_over_min"]["lm/w8/1gbit_0.1ms"]["embrace_schedule"] == 1.2
    assert "error" in s["simulator"] or s["simulator"].get("skipped")  # no profiles: said, not raised


def test_markdown_names_each_run_and_its_commit(tmp_path, capsys):
    a = _bench(tmp_path, "w4", [_run("lm", 4, "deepspeed", [2.0, 2.2]), _run("lm", 4, "embrace_schedule", [1.0, 1.1])],
               "c" * 40)
    assert main([str(a), "--out", str(tmp_path / "summary")]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "cccccccccc" in md and "`bench w4`" in md and "| lm | 4 | 1 Gbit/s | 2.00x [" in md
    assert json.loads((tmp_path / "summary.json").read_text())["speedups"][0]["baseline"] == "deepspeed"


def test_bytes_over_the_best_design_measured():
    """Each strategy's bytes over the lowest minimum of any strategy on those batches, not
    over its own formula (which a stock all-reduce meets by construction)."""
    from embrace_fairseq.perf.bench.summary import bytes_over_best

    runs = [dict(_run("lm", 4, "fairseq_c10d", [1.0]), min_bytes_per_rank_per_step=100.0,
                 bytes_total_per_rank_per_step=100.0),
            dict(_run("lm", 4, "embrace_schedule", [1.0]), min_bytes_per_rank_per_step=20.0,
                 bytes_total_per_rank_per_step=21.0),
            dict(_run("lm", 4, "compute_floor", [1.0]), min_bytes_per_rank_per_step=0.0,
                 bytes_total_per_rank_per_step=0.0)]
    assert bytes_over_best(runs) == {"lm/w4/1gbit_0.1ms": {"fairseq_c10d": 5.0, "embrace_schedule": 1.05}}


def test_each_run_is_read_with_the_statistic_it_recorded(tmp_path):
    steps = {"fairseq_c10d": [2.0, 2.0, 8.0], "embrace_schedule": [1.0, 1.0, 1.0], "compute_floor": [1.0, 1.0, 1.0]}
    old = _bench(tmp_path, "old", [_run("lm", 4, s, v) for s, v in steps.items()], "d" * 40)
    new = _bench(tmp_path, "new", [_run("lm", 8, s, v) for s, v in steps.items()], "e" * 40, ratio_statistic="mean")
    s = summarize([old, new])
    got = {x["world_size"]: (x["ratio"], x["statistic"]) for x in s["speedups"]}
    # the older run's ratio of medians (2 s / 1 s), the newer one's ratio of total times (12 s / 3 s)
    assert got == {4: (2.0, "median"), 8: (4.0, "mean")}
    assert s["over_floor"]["lm/w8/1gbit_0.1ms"]["fairseq_c10d"] == 4.0
    assert s["statistics"] == ["mean", "median"]
    assert main([str(old), str(new), "--out", str(tmp_path / "summary")]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "as its run recorded" in md and "| mean |" in md and "| median |" in md
