"""The replicated bias of a vocab-parallel output layer (RoBERTa's LM head): its gradient
is scaled in float32 before its one rounding and every rank holds the data-parallel
average, so under fp16 a bias gradient whose sum over the ranks passes 65,504 (and whose
average does not) stays finite, as under stock DDP, where each rank holds its own
tokens' sum (real gloo ranks, CPU half tensors, against a float64 full-logits reference)."""
import numpy as np
import pytest

import rank_fns_bias_fp16 as fns
from embrace_fairseq.tools.local_ranks import run_ranks


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_bias_gradient_past_the_half_range_of_its_sum(world):
    res = run_ranks(fns.bias_gradient, world, "float16", "contiguous", 40000.0, timeout_s=120)
    want = res[0]["reference"]
    assert abs(want[fns.HOT]) * world > 65504 > abs(want[fns.HOT])  # the sum overflows, the average not
    for r in res:
        assert r["dtype"] == "torch.float16" and np.isfinite(r["grad"]).all(), r["grad"]
        # every rank holds the average (one rounding of it to fp16): the dense average keeps it
        assert np.abs(r["grad"] - want).max() <= 2.0 ** -10 * np.abs(want).max(), (r["grad"], want)
        assert np.abs(r["average"] - want).max() <= 2.0 ** -10 * np.abs(want).max()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_float32_bias_gradient_is_the_reference_average(layout):
    for r in run_ranks(fns.bias_gradient, 3, "float32", layout, 1.0, timeout_s=120):
        np.testing.assert_allclose(r["average"], r["reference"], rtol=1e-5, atol=1e-6)
