"""Compute-matched regimes: the real models' ratios by hand, the link calibration, the limit,
core pinning, and (slow) the benchmark's ``--regime`` end to end on loopback."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from embrace_fairseq.perf.bench.calibration import (MAX_WARM_STEPS, c10d_bytes, calibrate, is_warm, limit_steps,
                                                    link_for_regime)
from embrace_fairseq.perf.bench.report import regime_check
from embrace_fairseq.perf.simulator.paper import PAPER_LATENCY_S
from embrace_fairseq.perf.simulator.real_models import REAL_MODEL_OF, REAL_MODELS, real_model_of
from embrace_fairseq.perf.simulator.regimes import REGIMES, c10d_comm_ratio, get_regime, regime_terms

REPO = Path(__file__).resolve().parents[2]


def _params(name):
    p = REAL_MODELS[name].profile(REGIMES["v100-25g"])
    return p.dense_numel + p.vocab * p.dim


def test_regimes_as_stated():
    v, a = REGIMES["v100-25g"], REGIMES["a100-100g"]
    assert (v.sustained_flops, v.memory_bytes_per_s, v.gbit_per_gpu, v.wire_bytes) == (30e12, 900e9, 25.0, 2)
    assert (a.sustained_flops, a.memory_bytes_per_s, a.gbit_per_gpu, a.wire_bytes) == (120e12, 1.5e12, 100.0, 2)
    assert v.latency_s == a.latency_s == PAPER_LATENCY_S
    assert set(REAL_MODEL_OF) == {"xlmr", "mbart", "m2m", "translation", "lm", "gpt_lm"}
    with pytest.raises(ValueError, match="v100-25g"):
        get_regime("h100")
    with pytest.raises(ValueError, match="iwslt"):
        real_model_of("iwslt")


def test_real_models_have_their_released_sizes():
    # GPT-2 small: exactly the released count (wte + wpe + 12 blocks + ln_f)
    d, f = 768, 3072
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
    assert _params("gpt2_small") == 50257 * d + 1024 * d + 12 * block + 2 * d == 124_439_808
    # the others against their published sizes (Hugging Face model cards), within 1 %, and
    # exactly the count of fairseq's layouts of the released checkpoints
    for name, published, exact in (("xlmr_base", 278e6, 278_294_418), ("mbart_large", 611e6, 610_851_840),
                                   ("m2m100_418m", 484e6, 483_905_536)):
        assert abs(_params(name) / published - 1) < 0.01, (name, _params(name))
        assert _params(name) == exact, name


def test_gpt2_ratio_by_hand():
    """c10d on GPT-2 small, 4 GPUs of v100-25g: the ring's bytes over 25 Gbit/s plus
    2(N-1) latencies per 25 MB bucket, over forward + backward + Adam at the regime's rates."""
    d, vocab, ctx, tokens, n = 768, 50257, 1024, 8192, 4
    params = 124_439_808
    dense_no_pos = params - vocab * d - ctx * d  # positions are looked up, not multiplied
    flops = 6 * dense_no_pos * tokens + 6 * 12 * ctx * d * tokens + 6 * vocab * d * tokens
    floor = flops / 30e12 + params * 32 / 900e9
    wire = 2 * (n - 1) / n * params * 2 / (25e9 / 8)
    t = regime_terms("gpt2_small", "v100-25g", n)
    assert t["floor_s"] == pytest.approx(floor, rel=1e-12)
    # what is left is the buckets' latency: a whole number of 2(N-1) message steps, one
    # set per 25 MB bucket, at least ceil(bytes / 25 MB) of them
    buckets = (t["comm_s"] - wire) / (2 * (n - 1) * 10e-6)
    assert buckets == pytest.approx(round(buckets), abs=1e-6)
    assert -(-params * 2 // (25 << 20)) <= round(buckets) <= 20
    assert c10d_comm_ratio("gpt2_small", "v100-25g", n) == pytest.approx((wire + round(buckets) * 60e-6) / floor)


def test_every_real_model_ratio_falls_with_the_faster_network():
    for name in REAL_MODELS:
        v, a = (c10d_comm_ratio(name, r, 4) for r in ("v100-25g", "a100-100g"))
        # 4x compute and 4x bandwidth: the ring's share is the same, the latency and the
        # memory-bound optimizer (only 1.67x faster) move it
        assert 0.05 < a < v < 10, (name, v, a)


def test_c10d_bytes_and_the_link_by_hand():
    # one table (V x D) and the dense parameters, fp32, ring all-reduce on 4 ranks: 2 (N-1)/N
    assert c10d_bytes(4, [{"vocab": 1000, "dim": 8}], 500) == pytest.approx(1.5 * (8000 + 500) * 4)
    # two tables (encoder's, decoder's): the dense parameters counted once
    assert c10d_bytes(2, [{"vocab": 100, "dim": 4}, {"vocab": 50, "dim": 4}], 10) == pytest.approx(
        (400 + 10 + 200) * 4)
    link = link_for_regime(ratio=0.8, floor_s=0.5, c10d_bytes_per_step=1e8, real_floor_s=0.1, latency_s=1e-5)
    assert link["bytes_per_s"] == pytest.approx(1e8 / 0.4) and link["gbit"] == pytest.approx(2.0)
    assert link["scale"] == pytest.approx(5.0) and link["latency_ms"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="positive"):
        link_for_regime(0.0, 0.5, 1e8, 0.1, 1e-5)


def test_calibrate_keeps_the_regimes_ratio_on_the_bench():
    tables, dense, world = [{"vocab": 8000, "dim": 256}], 2_000_000, 4
    cal = calibrate("translation", world, [0.5, 0.7, 0.6], tables, dense, ["v100-25g", "a100-100g"],
                    latency_applied=False)
    for c in cal:
        terms = regime_terms("transformer_base_wmt_en_de", c["regime"], world)
        assert c["floor_s"] == 0.6 and c["ratio"] == pytest.approx(terms["ratio"])
        # the bench's c10d bytes over the link take the regime's share of the measured floor
        assert c10d_bytes(world, tables, dense) / c["bytes_per_s"] == pytest.approx(terms["ratio"] * 0.6)
        assert c["scale"] == pytest.approx(0.6 / terms["floor_s"])
        assert c["latency_ms"] == pytest.approx(1e3 * 10e-6 * c["scale"]) and c["latency_applied"] is False


def _run(strategy, steps, min_bytes, regime="v100-25g", gbit=2.0):
    return {"model": "lm", "world_size": 2, "link_gbit": gbit, "latency_ms": 0.1, "regime": regime,
            "strategy": strategy, "step_s": steps, "min_bytes_per_rank_per_step": min_bytes}


def test_the_limit_is_the_floor_or_the_least_bytes_over_the_link():
    assert limit_steps([0.3, 0.2], 62.5e6, 2.0) == pytest.approx([0.3, 0.25])  # 62.5 MB at 250 MB/s: 0.25 s
    runs = [_run("compute_floor", [0.3, 0.2], 0.0), _run("fairseq_c10d", [0.9, 0.75], 200e6),
            _run("embrace_schedule", [0.6, 0.55], 62.5e6)]
    out = regime_check(runs, {"lm/w2/v100-25g": {"regime": "v100-25g", "gbit": 2.0}})
    lim = out["lm/w2/v100-25g"]["limit"]
    # EmbRace's minimum is the least (the floor's zero does not count)
    assert lim["min_bytes_of"] == "embrace_schedule" and lim["limit_steps_s"] == pytest.approx([0.3, 0.25])
    assert lim["limit_s"] == pytest.approx(0.275) and lim["bound_by"] == "compute"
    over = lim["over_limit"]
    assert over["fairseq_c10d"]["ratio"] == pytest.approx(0.825 / 0.275)
    # the geometric mean of the paired ratios 0.6 / 0.3 and 0.55 / 0.25
    assert over["embrace_schedule"]["low"] <= over["embrace_schedule"]["ratio"] == pytest.approx((2.0 * 2.2) ** 0.5)
    # a slower link: the bytes bound every step
    runs = [dict(r, link_gbit=0.5) for r in runs]
    lim = regime_check(runs, {"lm/w2/v100-25g": {"regime": "v100-25g"}})["lm/w2/v100-25g"]["limit"]
    assert lim["limit_steps_s"] == pytest.approx([1.0, 1.0]) and lim["bound_by"] == "link"


def test_regime_arguments_are_checked():
    from embrace_fairseq.perf.bench.__main__ import parse_args

    a = parse_args(["--regime", "v100-25g,A100-100G", "--models", "translation", "--strategies", "fairseq_c10d"])
    assert a.regimes == ["v100-25g", "a100-100g"] and a.strategies == ["fairseq_c10d", "compute_floor"]
    assert parse_args(["--models", "translation"]).regimes == []
    for bad in (["--regime", "h100"], ["--regime", "v100-25g", "--models", "iwslt"],
                ["--regime", "v100-25g", "--gbit", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_pinned_rank_runs_on_its_core():
    from embrace_fairseq.perf.bench.__main__ import _pinned

    cores = sorted(os.sched_getaffinity(0))
    for rank in range(2):
        out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             preexec_fn=_pinned(SimpleNamespace(pin_cores=True), rank), capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out) == [cores[rank % len(cores)]]
    assert _pinned(SimpleNamespace(pin_cores=False), 0) is None


@pytest.mark.slow
def test_regime_smoke_on_loopback(tmp_path):
    """``--regime`` on the translation model, 2 ranks, one step: the runs carry their regime,
    the links are named by it, the calibration and the limit are in bench.json and the report."""
    out = tmp_path / "regime"
    proc = subprocess.run(
        [sys.executable, "-m", "embrace_fairseq.perf.bench", "--regime", "v100-25g,a100-100g", "--models",
         "translation", "--worlds", "2", "--rounds", "1", "--steps-per-round", "1", "--warmup", "1",
         "--calibration-steps", "2", "--loopback", "--strategies", "fairseq_c10d,embrace_schedule", "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((out / "bench.json").read_text())
    keys = {"translation/w2/v100-25g", "translation/w2/a100-100g"}
    assert set(res["regimes"]) == keys and set(res["ratios"]) == keys
    assert {(r["regime"], r["strategy"]) for r in res["runs"]} == {
        (g, s) for g in ("v100-25g", "a100-100g") for s in ("fairseq_c10d", "embrace_schedule", "compute_floor")}
    for key, c in res["regimes"].items():
        regime = key.rsplit("/", 1)[1]
        assert c["regime"] == regime and c["real_model"] == "transformer_base_wmt_en_de"
        assert c["ratio"] == pytest.approx(c10d_comm_ratio("transformer_base_wmt_en_de", regime, 2))
        assert len(c["floor_steps_s"]) == 2 and c["floor_s"] > 0 and c["link_applied"] is False
        # timed only once warm: at least two untimed steps, the last two agreeing unless the cap ran out
        warm = c["warm_steps_s"]
        assert 2 <= len(warm) <= MAX_WARM_STEPS and (is_warm(warm) or len(warm) == MAX_WARM_STEPS)
        assert c["c10d_bytes_per_rank_per_step"] / c["bytes_per_s"] == pytest.approx(c["ratio"] * c["floor_s"])
        assert c["scale"] == pytest.approx(c["floor_s"] / c["real_floor_s"])
        run = next(r for r in res["runs"] if r["regime"] == regime)
        assert run["link_gbit"] == pytest.approx(c["gbit"])
        lim = c["limit"]
        assert lim["min_bytes_of"] == "embrace_schedule" and lim["limit_s"] > 0
        assert set(lim["over_limit"]) == {"fairseq_c10d", "embrace_schedule", "compute_floor"}
        assert (out / "traces" / f"translation_w2_{regime}").is_dir()
    report = (out / "report.md").read_text()
    assert "## Compute-matched regimes" in report and "## translation/w2/v100-25g" in report
    assert "not applied" in report


def test_report_section_names_the_calibration_and_the_shapes():
    from embrace_fairseq.perf.bench.markdown import regimes_section

    runs = [_run("compute_floor", [0.3, 0.2], 0.0), _run("embrace_schedule", [0.6, 0.55], 62.5e6)]
    cal = {"regime": "v100-25g", "real_model": "gpt2_small", "real_model_description": "GPT-2 small: tied",
           "ratio": 0.54, "floor_s": 0.25, "scale": 1.1, "gbit": 2.0, "latency_ms": 0.011, "link_applied": True,
           "latency_applied": False}
    result = {"regimes": regime_check(runs, {"lm/w2/v100-25g": cal}), "meta": {"ratio_statistic": "mean"},
              "workload_shapes": {"lm": {"name": "lm", "vocab": 66000, "share": 0.68994, "real_model": None}}}
    text = "\n".join(regimes_section(result))
    assert "| lm/w2/v100-25g | gpt2_small | 0.540 | 0.250 | 1.1 | 2 | 11 µs, not applied (no sch_netem) | 0.275 |" in text
    assert "(e) EmbRace, 2D schedule | 2.10" in text and "- lm: vocab 66,000, share 0.69\n" in text + "\n"
    assert regimes_section({"meta": {}}) == []
