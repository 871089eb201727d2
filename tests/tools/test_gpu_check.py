"""scripts/gpu_check.sh --cpu-smoke: the GPU check's drivers run on CPU/gloo where they can
(the exchange on a forced world of one, the native kernels, the vocab-parallel loss), plan the GPU-only runs, and
write the JSON the GPU run writes."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    plain, efficient = checks["fairseq"]["detail"]["planned"][1], checks["fairseq"]["detail"]["planned"][3]
    assert "embrace_transformer" in plain and "--fp16" in plain and "--memory-efficient-fp16" not in plain
    assert "embrace_transformer" in efficient and "--memory-efficient-fp16" in efficient and "nccl" in efficient
    assert set(checks["deepspeed"]["detail"]["planned"]) == {"fp16", "bf16"}


def _driver(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def test_script_parses_and_every_check_has_a_body_and_a_limit():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "harness")]
    try:
        import gpu_check
        import gpu_check_workers
    finally:
        del sys.path[:2]
    assert set(gpu_check.CHECKS) == set(gpu_check_workers.workers()) == set(gpu_check.TIMEOUTS)
    assert {"lifetimes", "relaxed_overlap", "timing", "native_paths", "deepspeed_fp16_skip"} <= set(gpu_check.CHECKS)
    assert gpu_check.TOTAL_S <= 540 and all(0 < t <= 600 for t in gpu_check.TIMEOUTS.values())
    assert gpu_check.GPU_ONLY <= set(gpu_check.CHECKS)
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "lifetimes,no_such_check"])


def test_dry_run_lists_the_plan(tmp_path):
    out = _driver("--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    names = [c["name"] for c in plan["checks"]]
    assert names[:4] == ["native_paths", "lifetimes", "relaxed_overlap", "timing"] and "fairseq_resume" in names
    assert all(c["command"][2:4] == ["--worker", c["name"]] and c["timeout_s"] > 0 for c in plan["checks"])
    assert not any(tmp_path.iterdir())  # nothing run, nothing written


def test_a_run_out_of_time_still_writes_a_summary(tmp_path):
    """Every check past the run's time limit is reported as not run, the others go on, and
    the summary names them (here the limit is long gone before the first check)."""
    out = _driver("--cpu-smoke", "--out", str(tmp_path), "--only", "native_paths,timing",
                  env={"EMBRACE_GPU_CHECK_T0": str(time.time() - 10_000)})
    assert out.returncode == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["failed"] == ["native_paths", "timing"] and not res["partial"]
    assert all("no time left" in c["detail"] for c in res["checks"])


def test_native_paths_on_cpu(tmp_path):
    """The forced kernel paths' check on CPU (the CPU op at 1024+ owners, dense/sort, a bad
    index raising the package's error)."""
    out = _driver("--cpu-smoke", "--out", str(tmp_path), "--only", "native_paths", timeout=300)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    check = res["checks"][0]
    assert out.returncode == 0, check
    if check["status"] == "skip":  # built without the extension on purpose
        assert "native ops unavailable" in check["detail"]
        return
    assert check["status"] == "pass" and check["detail"]["context_alive_after_bad_index"] is True
    assert check["detail"]["dedup_world4096"].startswith("dense, sort and auto")


@pytest.mark.slow
def test_cpu_smoke_of_the_device_checks(tmp_path):
    """lifetimes (world of one and two gloo ranks), relaxed rows against the CPU
    reference, timing: their CPU runs pass; what only a GPU shows is named."""
    out = _driver("--cpu-smoke", "--out", str(tmp_path), "--only", "lifetimes,relaxed_overlap,timing", timeout=600)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out.returncode == 0, res
    checks = {c["name"]: c for c in res["checks"]}
    assert checks["lifetimes"]["detail"]["world_of_one"] == {"all_to_all_single_async": 0, "all_reduce_async": 0,
                                                             "all_gather_async": 0}
    assert len(checks["lifetimes"]["detail"]["gloo_two_ranks"]) == 2
    assert checks["relaxed_overlap"]["detail"]["weights_max_abs_diff"] <= 1e-5
    assert checks["relaxed_overlap"]["detail"]["rows_moved"] > 0
    assert all("gpu_only" in c["detail"] for c in checks.values())
