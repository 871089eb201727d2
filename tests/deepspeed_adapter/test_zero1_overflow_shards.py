"""ZeRO-1 with ``zero_optimization.compute_grad_norm: false``: DeepSpeed's overflow check is
then its only skip decision, and it must see the table shards' gradients, on every rank.
DeepSpeed's fp16 does not run on CPU: the decision (``has_overflow``, with its all-reduce)
is taken on a real fp32 ZeRO-1 engine in gloo ranks; the fp16 end-to-end skip is in
``scripts/gpu_check.sh`` (check ``deepspeed``)."""
import os

import pytest

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import rank_fns_gpu_paths as R  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402


def test_nonfinite_shard_gradient_is_an_overflow_on_every_rank():
    results = run_ranks(R.zero1_overflow_decision, 2, timeout_s=300, pg_timeout_s=120)
    assert results == [{False: False, True: True}, {False: False, True: True}], results
