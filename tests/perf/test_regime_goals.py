"""The regime goals read a results file as the issue states them: every ratio judged on its
interval's lower end, the limit read as a speed-up, the targets per workload and regime."""
from embrace_fairseq.perf.bench.regime_goals import goals_markdown, regime_goal_check


def _iv(ratio, low, high, steps=8):
    return {"ratio": ratio, "low": low, "high": high, "steps": steps}


def _result():
    runs = [{"model": m, "world_size": 2, "regime": g, "strategy": s}
            for m in ("xlmr", "translation") for g in ("v100-25g", "a100-100g")
            for s in ("fairseq_c10d", "embrace_schedule", "compute_floor")]
    return {
        "runs": runs,
        "ratio_intervals": {
            # 1.6x but the lower end 1.35 misses 1.4 in v100-25g; 1.45 meets it in a100-100g
            "xlmr/w2/v100-25g": {"fairseq_c10d": _iv(1.6, 1.35, 1.8), "compute_floor": _iv(0.4, 0.3, 0.5)},
            "xlmr/w2/a100-100g": {"fairseq_c10d": _iv(1.6, 1.45, 1.8)},
            # never slower: lower end 0.975 passes the 0.97 margin
            "translation/w2/v100-25g": {"fairseq_c10d": _iv(1.0, 0.975, 1.02), "embrace_fifo": _iv(1.2, 1.16, 1.25)},
            "translation/w2/a100-100g": {"fairseq_c10d": _iv(1.0, 0.96, 1.02)},
        },
        "regimes": {"xlmr/w2/v100-25g": {"limit": {"over_limit": {"embrace_schedule": _iv(1.1, 1.05, 1.14)}}},
                    "xlmr/w2/a100-100g": {"limit": {"over_limit": {"embrace_schedule": _iv(1.1, 1.05, 1.2)}}}},
        "simulator": {"fitted_on": {"model": "translation", "regime": "v100-25g"},
                      "by_model": {"xlmr": {"mean_abs_rel_error": 0.14, "count": 2},
                                   "translation": {"mean_abs_rel_error": 0.16, "count": 1}}},
    }


def test_each_goal_is_judged_on_the_lower_end_of_its_interval():
    rows = {(r["run"], r["goal"]): r for r in regime_goal_check(_result())}
    assert rows[("xlmr/w2/v100-25g", "(e) over fairseq_c10d")]["verdict"] == "MISSED"
    assert rows[("xlmr/w2/a100-100g", "(e) over fairseq_c10d")]["verdict"] == "met"
    assert rows[("translation/w2/v100-25g", "(e) over fairseq_c10d")]["verdict"] == "met"
    assert rows[("translation/w2/a100-100g", "(e) over fairseq_c10d")]["verdict"] == "MISSED"
    assert rows[("translation/w2/v100-25g", "(e) over embrace_fifo")]["verdict"] == "met"
    # the floor is no baseline
    assert not any(g == "(e) over compute_floor" for _, g in rows)
    # step / limit up to 1.14 is within 1.15x; an upper end of 1.2 is not
    assert rows[("xlmr/w2/v100-25g", "limit over (e)")]["verdict"] == "met"
    assert rows[("xlmr/w2/a100-100g", "limit over (e)")]["verdict"] == "MISSED"
    assert abs(rows[("xlmr/w2/a100-100g", "limit over (e)")]["low"] - 1 / 1.2) < 1e-12
    sim = {r["run"].split()[0]: r["verdict"] for r in regime_goal_check(_result()) if r["low"] is None}
    assert sim == {"xlmr": "met", "translation": "MISSED"}


def test_the_table_names_the_ranks_measured():
    text = "\n".join(goals_markdown(regime_goal_check(_result()), "x"))
    assert "| xlmr/w2/v100-25g | 2 | (e) over fairseq_c10d | 1.40x | 1.60x [1.35, 1.80] (8 steps) | MISSED |" in text
    assert goals_markdown([]) == []


def test_performance_row_takes_the_fastest_baseline_and_the_limit():
    from embrace_fairseq.perf.bench.regime_goals import performance_rows

    r = _result()
    r["ratio_intervals"]["xlmr/w2/v100-25g"]["sparse_allgather"] = _iv(1.5, 1.4, 1.6)
    r["regimes"]["xlmr/w2/v100-25g"].update(regime="v100-25g", real_model="xlmr_base", gbit=0.0158)
    r["meta"] = {"source": {"commit": "0123456789abcdef", "dirty": False}}
    rows = performance_rows("results/x", r)
    assert rows == ["| xlmr/w2/v100-25g | xlmr_base | 1.50x [1.40, 1.60] (sparse_allgather) | "
                    "1.60x [1.35, 1.80] | - | 1.10x [1.05, 1.14] | - | 0123456 |"]
    # beside it, the projection of the real model in the same regime, one NIC per GPU, 16-64 GPUs
    def proj(world, regime, topo, c10d, e, auto):
        return {"world_size": world, "regime": regime, "topology": topo,
                "step_s": {"fairseq_c10d": c10d, "embrace_schedule": e, "embrace_auto": auto}}
    projection = {"models": {"xlmr_base": {"results": [
        proj(16, "v100-25g", "flat", 2.0, 1.0, 1.0), proj(64, "v100-25g", "flat", 1.5, 1.0, 0.9),
        proj(16, "a100-100g", "flat", 9.0, 1.0, 1.0), proj(16, "v100-25g", "nodes_of_8", 9.0, 1.0, 1.0)]}}}
    (row,) = performance_rows("results/x", r, projection)
    assert row.endswith("| 1.10x [1.05, 1.14] | 1.50-2.00x / 1.67-2.00x | 0123456 |"), row


def test_a_run_whose_floor_drifted_from_its_calibration_is_flagged():
    r = _result()
    # the timed floor's mean, as the report's limit records it (9 and 11 s; 2 and 3 s)
    for regime, timed in (("v100-25g", [9.0, 11.0]), ("a100-100g", [2.0, 3.0])):
        cal = r["regimes"][f"xlmr/w2/{regime}"]
        cal["floor_s"] = 10.0
        cal["limit"].update(floor_s=sum(timed) / len(timed), limit_steps_s=timed)
    rows = {(x["run"], x["goal"]): x for x in regime_goal_check(r)}
    held = rows[("xlmr/w2/v100-25g", "calibration held (timed floor / calibrated floor)")]
    drifted = rows[("xlmr/w2/a100-100g", "calibration held (timed floor / calibrated floor)")]
    assert held["verdict"] == "held" and abs(held["ratio"] - 1.0) < 1e-12
    assert drifted["verdict"].startswith("DRIFTED") and abs(drifted["ratio"] - 0.25) < 1e-12
    assert "| 0.80-1.25x | 0.25x (2.500 s / 10.000 s) | DRIFTED" in "\n".join(goals_markdown(list(rows.values())))
    # every verdict of the drifted run says so; the held one's do not
    assert rows[("xlmr/w2/a100-100g", "(e) over fairseq_c10d")]["verdict"] == "met (calibration drifted)"
    assert rows[("xlmr/w2/v100-25g", "(e) over fairseq_c10d")]["verdict"] == "MISSED"
    from embrace_fairseq.perf.bench.regime_goals import performance_rows

    r["regimes"]["xlmr/w2/a100-100g"].update(regime="a100-100g", real_model="xlmr_base")
    (row,) = performance_rows("results/x", r)
    assert row.startswith("| xlmr/w2/a100-100g (calibration drifted 0.25x) | xlmr_base |")


def test_a_verdict_needs_eight_steps_and_the_gpt2_lm_is_never_slower():
    r = _result()
    r["runs"].append({"model": "gpt_lm", "world_size": 2, "regime": "v100-25g", "strategy": "fairseq_c10d"})
    r["ratio_intervals"]["gpt_lm/w2/v100-25g"] = {"fairseq_c10d": _iv(1.0, 0.96, 1.05)}
    r["ratio_intervals"]["xlmr/w2/a100-100g"]["fairseq_c10d"] = _iv(1.6, 1.45, 1.8, steps=3)
    rows = {(x["run"], x["goal"]): x for x in regime_goal_check(r)}
    assert rows[("gpt_lm/w2/v100-25g", "(e) over fairseq_c10d")]["target"] == 0.97
    assert rows[("gpt_lm/w2/v100-25g", "(e) over fairseq_c10d")]["verdict"] == "MISSED"
    assert rows[("xlmr/w2/a100-100g", "(e) over fairseq_c10d")]["verdict"] == "too few steps (3 < 8)"


def test_the_default_plan_is_judged_against_the_fastest_other_and_its_prediction():
    """embrace_auto: paired steps against every other strategy but the floor (the fastest
    decides), lower end at least 0.97; its plan's predicted step within 15 % of the mean."""
    from embrace_fairseq.perf.bench.regime_goals import auto_rows, performance_rows

    steps = {"fairseq_c10d": [1.0, 1.1, 1.0, 1.05] * 2, "embrace_schedule": [1.2, 1.25, 1.2, 1.3] * 2,
             "compute_floor": [0.5] * 8, "embrace_auto": [1.0, 1.08, 1.01, 1.04] * 2}
    plan = {"spec": "embed_tokens=replicate", "schedule": False, "predicted_step_s": 0.8}
    runs = [{"model": "translation", "world_size": 4, "regime": "v100-25g", "strategy": s, "step_s": t,
             "settings": {"plan": plan} if s == "embrace_auto" else {}} for s, t in steps.items()]
    rows = {r["goal"].split(" (")[0]: r for r in auto_rows({"runs": runs}, "translation", 4, "v100-25g")}
    fastest = rows["auto"]
    assert "fairseq_c10d" in fastest["goal"] and "compute_floor" not in fastest["goal"]
    assert fastest["verdict"] == "met" and 0.97 <= fastest["low"] <= 1.0 <= fastest["high"]
    pred = rows["auto's predicted step against the measured"]
    assert pred["verdict"] == "MISSED" and pred["ratio"] < -0.15  # 0.8 s against a mean of 1.03 s
    # slower than the fastest by 10 %: missed
    slow = [dict(r, step_s=[1.1 * x for x in steps["fairseq_c10d"]]) if r["strategy"] == "embrace_auto" else r
            for r in runs]
    assert auto_rows({"runs": slow}, "translation", 4, "v100-25g")[0]["verdict"] == "MISSED"
    # without the strategy, nothing to judge; the table's cell names what the plan did
    assert auto_rows({"runs": runs[:3]}, "translation", 4, "v100-25g") == []
    result = {"runs": runs, "ratio_intervals": {"translation/w4/v100-25g": {
        "fairseq_c10d": {"ratio": 0.85, "low": 0.8, "high": 0.9, "steps": 8}}},
        "regimes": {"translation/w4/v100-25g": {"regime": "v100-25g", "real_model": "transformer_base"}}}
    (row,) = performance_rows("f", result)
    assert "(stock)" in row
