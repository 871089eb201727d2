"""Every file of ds_config/ is either trained with on CPU here or says in its own
"description" that it is untested (and why): the example configs are the tested ones."""
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_deepspeed as R  # noqa: E402
import rank_fns_ds_configs as C  # noqa: E402
from embrace_fairseq.deepspeed_adapter.config import check_supported, split_config  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "ds_config").glob("*.json"))


def _gpu_only(cfg):
    return (cfg.get("fp16") or {}).get("enabled", False)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_says_whether_it_is_tested(path):
    cfg = json.loads(path.read_text())
    ds, embrace = split_config(dict(cfg))
    check_supported(ds, embrace)
    description = cfg.get("description", "")
    assert description, f"{path.name}: no \"description\""
    # a GPU-only file says it is untested here; a CPU file is trained below
    assert ("untested" in description.lower()) == _gpu_only(cfg), (path.name, description)


CPU_CONFIGS = [p for p in CONFIGS if not _gpu_only(json.loads(p.read_text()))]


# one DeepSpeed engine (two with an "embrace" section) per file, on 2 ranks: 1-4 s each
@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.name)
def test_cpu_config_trains_as_stock_deepspeed(path, tmp_path):
    """2 real gloo ranks, 3 optimizer steps: the file's EmbRace run gives stock DeepSpeed's
    losses and weights (within 1e-4) on the same file without its "embrace" section."""
    results = run_ranks(C.train_with_config, 2, str(path), 3, str(tmp_path), timeout_s=300, pg_timeout_s=120)
    for rank, res in enumerate(results):
        ref = res[False]
        assert len(ref["losses"]) >= 3 and all(x == x for x in ref["losses"]), (rank, ref["losses"])
        if True in res:
            got = res[True]
            assert got["steps"] == ref["steps"] == 3
            assert R.rel_diff(got["losses"], ref["losses"]) < 1e-4, (rank, got["losses"], ref["losses"])
            for name in ref["state"]:
                assert R.rel_diff(got["state"][name], ref["state"][name]) < 1e-4, (rank, name)
