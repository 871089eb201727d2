"""scripts/gpu_check.sh --cpu-smoke: the GPU check's drivers run on CPU/gloo where they can
(the exchange on a forced world of one, the native kernels, the vocab-parallel loss), plan the GPU-only runs, and
write the JSON the GPU run writes."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_runs_and_writes_results(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(tmp_path),
                          "--only", "exchange,vocab_parallel,fairseq,deepspeed"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in res["checks"]}
    assert res["mode"] == "cpu-smoke" and not res["failed"]
    ex = checks["exchange"]
    assert ex["status"] == "pass" and ex["detail"]["backend"] == "gloo"
    assert ex["detail"]["forward_torch.float32"] == 0.0 and ex["detail"]["relaxed_vs_sync"] == 0.0
    vp = checks["vocab_parallel"]
    assert vp["status"] == "pass" and vp["detail"]["vp_loss_fp32"] <= 1e-4
    assert all(vp["detail"][f"two_ranks_step{i}_loss_rel"] <= 1e-5 for i in range(3))
    assert checks["fairseq"]["status"] == "skip" and len(checks["fairseq"]["detail"]["planned"]) == 4
    planned = checks["fairseq"]["detail"]["planned"][1]
    assert "embrace_transformer" in planned and "--memory-efficient-fp16" in planned and "nccl" in planned
    assert set(checks["deepspeed"]["detail"]["planned"]) == {"fp16", "bf16"}
