"""One verdict from several benchmark runs (perf/bench/pool.py): random-effects pooling."""
import json
import math

import pytest

from embrace_fairseq.perf.bench import pool
from embrace_fairseq.perf.bench.stats import no_worse


def _iv(ratio, half):
    return {"ratio": ratio, "low": ratio * math.exp(-half), "high": ratio * math.exp(half)}


def test_one_run_is_its_own_verdict():
    r = pool.pooled_ratio([_iv(0.97, 0.02)])
    assert r["runs"] == 1 and r["ratio"] == pytest.approx(0.97) and r["low"] == pytest.approx(0.97 * math.exp(-0.02))


def test_agreeing_runs_narrow_the_interval_and_add_no_between_run_variance():
    runs = [_iv(1.0, 0.03)] * 5
    r = pool.pooled_ratio(runs)
    assert r["ratio"] == pytest.approx(1.0) and r["tau"] == 0.0
    # five runs with the same standard error: sqrt(5) narrower, times t(4) / z
    half = math.log(r["high"])
    assert half == pytest.approx(0.03 / math.sqrt(5) * 2.776 / 1.959964, rel=1e-3)
    assert half < 0.03


def test_runs_that_disagree_widen_the_interval_beyond_each_run():
    # two runs whose own intervals do not overlap: the between-run spread dominates
    a, b = _iv(1.00, 0.01), _iv(0.95, 0.01)
    r = pool.pooled_ratio([a, b])
    assert r["tau"] > 0.02
    assert r["low"] < 0.95 and r["high"] > 1.00
    assert not no_worse(r)  # a noisy pair of runs proves nothing


def test_weights_follow_each_runs_precision():
    precise, vague = _iv(1.02, 0.005), _iv(0.90, 0.2)
    r = pool.pooled_ratio([precise, vague])
    assert abs(r["ratio"] - 1.02) < abs(r["ratio"] - 0.90)


def _bench(commit, ratios):
    return {"meta": {"source": {"commit": commit, "dirty": False}},
            "layouts": {k: {"contiguous_over_strided": _iv(v, 0.01)} for k, v in ratios.items()}}


def test_cli_pools_the_layout_checks_of_bench_files(tmp_path, capsys):
    dirs = []
    for i, (commit, ratios) in enumerate([("a" * 40, {"lm/w2": 1.00, "translation/w2": 1.05}),
                                           ("b" * 40, {"lm/w2": 0.99, "translation/w2": 1.06}),
                                           ("b" * 40, {"lm/w2": 1.01, "translation/w2": 1.04})]):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "bench.json").write_text(json.dumps(_bench(commit, ratios)))
        dirs.append(str(d))
    out = tmp_path / "pooled.md"
    assert pool.main([*dirs, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())["layouts"]
    assert len(data["lm/w2"]["runs"]) == 3 and data["lm/w2"]["no_worse"] and not data["lm/w2"]["better"]
    assert data["translation/w2"]["better"]
    text = capsys.readouterr().out
    assert "yes, faster" in text and "`aaaaaaaaaaaa`" in text and "`bbbbbbbbbbbb`" in text


def test_cli_refuses_runs_without_a_layout_comparison(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {}, "layouts": {}}))
    with pytest.raises(SystemExit, match="compared the layouts"):
        pool.main([str(tmp_path)])
