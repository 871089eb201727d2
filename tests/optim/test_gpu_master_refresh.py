"""The shard optimizer's fp32 masters of fp16/bf16 shards follow weights loaded after it
was built (weights-only checkpoint, reset optimizer): the first step must not write the
initial weights back."""
import pytest
import torch

from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_step_after_loading_weights_starts_from_them(dtype, kind):
    p = torch.nn.Parameter(torch.randn(6, 4).to(dtype))
    opt = ShardOptimizer([p], kind)
    loaded = torch.randn(6, 4).to(dtype)
    with torch.no_grad():
        p.copy_(loaded)  # what load_state_dict does
    p.grad = torch.zeros_like(p)
    opt.step(HyperParams(lr=0.1))  # zero gradient: Adam and SGD leave the weights as they are
    assert torch.equal(p.detach(), loaded)
    assert torch.equal(opt.state[0]["master"], loaded.float())


def test_masters_of_untouched_elements_keep_fp32_precision():
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    opt = ShardOptimizer([p], "sgd")
    opt.state[0]["master"].fill_(1e-4)  # rounds to bf16 1e-4 -> differs from the shard (0)
    with torch.no_grad():
        p.copy_(opt.state[0]["master"].to(p.dtype))
    opt.state[0]["master"][0, 0] = 1.00001e-4  # still rounds to the shard's value: kept
    p.grad = torch.zeros_like(p)
    opt.step(HyperParams(lr=0.1))
    assert opt.state[0]["master"][0, 0].item() == pytest.approx(1.00001e-4, rel=1e-7)
