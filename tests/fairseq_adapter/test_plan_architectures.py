"""``--embrace-plan`` on RoBERTa and BART: each plan trains as the stock architecture
(same per-update losses and gradient norms), and a RoBERTa checkpoint saved with the
sharded table (its head reading the table, the table saved once) resumes with the
replicated one (the stock head, the table under two names)."""
from __future__ import annotations

import shutil

import pytest

import test_bart as B
import test_roberta as R
from test_bart import denoising_data, mbart_data  # noqa: F401  (fixtures)
from test_roberta import lm_data  # noqa: F401  (fixture)


def _plan(plan):
    return ["--embrace-plan", plan]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,plan", [(2, "replicate"), (3, "auto"), (3, "embed_tokens=row-shard")])
def test_roberta_plans_train_as_stock(lm_data, tmp_path, nproc, plan):
    stock = R._train(lm_data, "roberta", tmp_path / "stock", nproc)
    ours = R._train(lm_data, "embrace_roberta", tmp_path / "ours", nproc, _plan(plan))
    R._assert_same(stock, ours, f"roberta x{nproc} {plan}")


@pytest.mark.slow
def test_roberta_sharded_checkpoint_resumes_replicated(lm_data, tmp_path):
    extra = ["--save-interval-updates", "5"]
    stock = R._train(lm_data, "roberta", tmp_path / "stock", 2, extra)
    R._train(lm_data, "embrace_roberta", tmp_path / "sharded", 2, [*extra, *_plan("shard")], max_update=5)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(tmp_path / "sharded" / "checkpoint_1_5.pt", resumed / "checkpoint_last.pt")
    again = R._train(lm_data, "embrace_roberta", resumed, 2, [*extra, *_plan("replicate")])
    want = {int(r["num_updates"]): float(r["loss"]) for r in stock.updates}
    got = {int(r["num_updates"]): float(r["loss"]) for r in again.updates}
    assert sorted(got) == list(range(6, 11))
    for k, v in got.items():
        assert abs(v - want[k]) <= R.REL * abs(want[k]), (k, v, want[k])


@pytest.mark.slow
@pytest.mark.parametrize("task,arch,nproc,plan", [("denoising", "bart_base", 2, "replicate"),
                                                  ("mbart", "mbart_base_wmt20", 3, "embed_tokens=row-shard"),
                                                  ("denoising", "bart_base", 3, "auto")])
def test_bart_plans_train_as_stock(task, arch, nproc, plan, mbart_data, denoising_data, tmp_path):
    data, flags = B._task(task, mbart_data, denoising_data)
    stock = B._train(data, arch, tmp_path / "stock", nproc, flags)
    ours = B._train(data, "embrace_" + arch, tmp_path / "ours", nproc, flags, _plan(plan))
    B._assert_same(stock, ours, f"{task} {arch} x{nproc} {plan}",
                   gnorm_rel=B.DENOISING_GNORM_REL if task == "denoising" else B.REL)
