"""The compute profile's machinery on CPU: stock fairseq models built at the released
dimensions the simulator counts, tiny ones stepped, their FLOPs counted as expected."""
import json
import math

import pytest

from embrace_fairseq.perf import gpu_profile as G
from embrace_fairseq.perf.simulator.real_models import REAL_MODELS


def test_every_released_model_has_a_spec_and_the_batch_the_simulator_counts():
    assert set(G.SPECS) == set(REAL_MODELS)
    for name, spec in G.SPECS.items():
        p = REAL_MODELS[name].build(1.0, 1.0, 2)
        assert spec.vocab == p.vocab, name
        # the simulator's tokens per GPU (per side for translation: its lookups are both sides')
        assert spec.tokens == pytest.approx(p.tokens_per_rank / (2 if spec.objective == "translation" else 1),
                                            rel=0.02), name


@pytest.mark.parametrize("name", ["transformer_base_wmt_en_de", "gpt2_small", "m2m100_418m"])
def test_built_models_have_the_simulators_parameters(name):
    """fairseq's arch with the spec's overrides is the model the simulator counts (the
    larger tables are built the same way; they take tens of seconds each to build here)."""
    model = G.build(G.SPECS[name]).model
    p = REAL_MODELS[name].build(1.0, 1.0, 2)
    # within fairseq's learned positions' padding_idx + 1 extra rows
    assert sum(x.numel() for x in model.parameters()) == pytest.approx(
        sum(n for _, n in p.dense_layers) + p.vocab * p.dim, abs=2 * p.dim)


def test_tiny_lm_step_counts_the_flops_of_its_matrix_products():
    """Independent arithmetic for one decoder layer (d 32, ffn 64) with a tied 500-row output:
    forward 2 FLOPs per weight per token plus QK^T and AV (2 * 2 * length * d per token);
    backward twice the forward."""
    spec = G.tiny_spec(G.SPECS["gpt2_small"])
    built = G.build(spec)
    import torch

    batch = G.sample(spec, built.task, torch.device("cpu"))
    tokens = batch["target"].numel()
    length = batch["target"].size(1)
    d, ffn = 32, 64
    weights = 4 * d * d + 2 * d * ffn + spec.vocab * d
    expected = 3 * (2 * tokens * weights + 4 * tokens * length * d)
    assert G.counted_flops(built, batch, torch.device("cpu"), autocast=False) == expected


def test_tiny_profile_of_every_model_on_cpu(tmp_path):
    out = tmp_path / "profile.json"
    assert G.main(["--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert "commit" in r and r["device"] == "cpu" and r["tiny"] is True
    assert [m["real_model"] for m in r["models"]] == list(G.SPECS)
    for m in r["models"]:
        assert m["counted_flops"] > 0 and m["forward_backward_ms"]["median"] > 0, m["real_model"]
        assert m["forward_backward_ms"]["n"] == 2 and len(m["losses"]) == 3
        assert all(math.isfinite(x) for x in m["losses"])
        assert "simulator_flops" not in m  # tiny models are not the released ones
    # the regimes' rates as shares of their GPUs' datasheet peaks
    assert r["regimes"]["v100-25g"]["share_of_peak"] == pytest.approx(30 / 125)
    assert r["regimes"]["a100-100g"]["share_of_peak"] == pytest.approx(120 / 312)


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert G.main(["--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    assert "no GPU is visible" in capsys.readouterr().err


def test_regimes_assumed_step_against_the_measured_one():
    """10 TFLOP of forward + backward: 1/3 s at v100-25g's 30 TFLOP/s, 1/12 s at a100-100g's
    120; a measured 0.25 s is 0.75x the one and 3x the other."""
    result = {"regimes": G.regime_shares(), "models": [
        {"real_model": "m", "tokens": 1, "simulator_flops": 10e12, "counted_over_simulator": 1.0,
         "forward_backward_ms": {"median": 250.0, "low": 200.0, "high": 300.0}, "sustained_tflops": 40.0,
         "share_of_matmul": 0.05}]}
    m = G.compare_to_regimes(result)["models"][0]["regimes"]
    assert m["v100-25g"]["assumed_forward_backward_ms"] == pytest.approx(1e3 / 3)
    assert m["v100-25g"]["measured_over_assumed"] == pytest.approx(0.75)
    assert m["a100-100g"]["measured_over_assumed"] == pytest.approx(3.0)
    table = G.markdown_table(result)
    assert "| m | 1 | 1.00x | 250.0 [200.0, 300.0] | 40.0 | 5.0 % | 333.3, 0.75x | 83.3, 3.00x |" in table
