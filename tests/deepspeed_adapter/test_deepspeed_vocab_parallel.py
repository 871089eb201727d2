"""embrace-ds-train with the vocab-parallel output layer ("output" in the "embrace" section)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError, parse_embrace_config

ROOT = Path(__file__).resolve().parents[2]
TINY_LM = ["--task", "language_modeling", "--arch", "embrace_transformer_lm", "--share-decoder-input-output-embed",
           "--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
           "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--max-tokens", "64",
           "--optimizer", "adam", "--lr", "0.003", "--dropout", "0", "--attention-dropout", "0",
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
           "--log-interval", "1", "--log-format", "json", "--seed", "3", "--max-update", "12", "--disable-validation",
           "--no-save"]


def test_output_key_is_validated():
    assert parse_embrace_config({}).output == "auto"
    assert parse_embrace_config({"output": "vocab-parallel"}).output == "vocab-parallel"
    with pytest.raises(EmbraceConfigError, match="embrace.output"):
        parse_embrace_config({"output": "sometimes"})
    # the output layer's table gradient computed behind the dense all-reduce unless turned off
    assert parse_embrace_config({}).defer_output_grad is True
    assert parse_embrace_config({"defer_output_grad": False}).defer_output_grad is False
    with pytest.raises(EmbraceConfigError, match="defer_output_grad"):
        parse_embrace_config({"defer_output_grad": "no"})


def _train(data, tmp_path, output, port, trace=None):
    from fairseq_corpus import fairseq_env

    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
           "embrace": {"output": output, **({"trace": str(trace)} if trace else {})}}
    path = tmp_path / f"ds_{output}.json"
    path.write_text(json.dumps(cfg))
    env = dict(fairseq_env(), EMBRACE_VENV=str(Path(sys.executable).parent.parent), DS_CONFIG=str(path),
               MASTER_PORT=str(port), EMBRACE_LOG_PRECISION="8")
    out = subprocess.run([str(ROOT / "scripts" / "ds_train_cpu.sh"), "2", str(data), *TINY_LM,
                          "--save-dir", str(tmp_path / output)], env=env, capture_output=True, text=True, timeout=500)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    from fairseq_corpus import losses_by_update

    return losses_by_update(text), text


@pytest.mark.slow
def test_vocab_parallel_same_losses_as_gather(tmp_path):
    pytest.importorskip("deepspeed")
    from fairseq_corpus import make_lm_corpus

    from embrace_fairseq.tools.local_ranks import free_port

    data = make_lm_corpus(tmp_path / "corpus", vocab_size=51, n_train=200,
                          extra_preprocess_args=["--padding-factor", "1"])
    gather, _ = _train(data, tmp_path, "gather", free_port())
    vp, text = _train(data, tmp_path, "vocab-parallel", free_port(), trace=tmp_path / "trace" / "vp")
    assert "EmbRace output layer: vocab-parallel (forced" in text, text[-3000:]
    # the criterion started every loss's token-count gather before the engine's forward
    # (on the overlapped lane): the engine it is called with wraps the configured model
    from embrace_fairseq.core.trace import TABLE_TID

    for rank in range(2):
        events = json.loads((tmp_path / "trace" / f"vp.rank{rank}.json").read_text())["traceEvents"]
        counts = [e["tid"] for e in events if e.get("name") == "softmax_stats" and e["args"].get("bytes") == 8]
        assert len(counts) >= 12 and set(counts) == {TABLE_TID}, counts
    assert sorted(gather) == sorted(vp) == list(range(1, 13))
    for u in gather:
        assert vp[u] == pytest.approx(gather[u], rel=1e-4), (u, gather, vp)
