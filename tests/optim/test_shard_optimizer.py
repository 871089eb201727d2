"""shard_optimizer: Adam / AdamW / SGD over row shards equal torch's optimizer on the full
table, row-subset steps equal one full step, fp16 shards keep an fp32 master."""
import pytest
import torch

from embrace_fairseq.core.shard_plan import ShardPlan
from embrace_fairseq.optim.shard_optimizer import HyperParams, ShardOptimizer, UnsupportedOptimizerError, kind_of

HP = HyperParams(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, momentum=0.9)


def torch_optimizer(kind, params, hp=HP):
    return {"adam": lambda: torch.optim.Adam(params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay),
            "adamw": lambda: torch.optim.AdamW(params, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                               weight_decay=hp.weight_decay),
            "sgd": lambda: torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay,
                                           dampening=hp.dampening, nesterov=hp.nesterov)}[kind]()


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_row_subset_steps_equal_one_full_step(kind):
    """Element-wise rules: a step on rows A then on the complement == one step on all rows."""
    torch.manual_seed(0)
    w = torch.randn(11, 4)
    grads = [torch.randn(11, 4) for _ in range(3)]
    full_p, split_p = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    full, split = ShardOptimizer([full_p], kind), ShardOptimizer([split_p], kind)
    a = torch.tensor([0, 3, 4, 9])
    b = torch.tensor([i for i in range(11) if i not in a.tolist()])
    for g in grads:
        full_p.grad, split_p.grad = g.clone(), g.clone()
        full.step(HP)
        split.begin_step(HP)
        split.apply([a])
        split.apply([b])
    assert torch.allclose(full_p, split_p, rtol=0, atol=1e-7)
    # and it is torch's rule
    ref_p = torch.nn.Parameter(w.clone())
    ref = torch_optimizer(kind, [ref_p])
    for g in grads:
        ref_p.grad = g.clone()
        ref.step()
    assert torch.allclose(full_p, ref_p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,hp", [
    ("adam", HP), ("adamw", HP), ("sgd", HP),
    ("sgd", HyperParams(lr=0.2, momentum=0.5, dampening=0.3)),
    ("sgd", HyperParams(lr=0.2, momentum=0.5, nesterov=True, weight_decay=0.01)),
    ("sgd", HyperParams(lr=0.3)),
])
@pytest.mark.parametrize("world", [2, 3])
def test_shards_step_like_torch_on_the_full_table(kind, hp, world):
    """Each shard of an 11-row table stepped by its own ShardOptimizer (as each rank does)
    == torch's optimizer on the full table, over several steps with a scaled gradient."""
    torch.manual_seed(1)
    full = torch.randn(11, 3)
    grads = [torch.randn(11, 3) for _ in range(4)]
    plan = ShardPlan(11, world, "contiguous")
    shards = [torch.nn.Parameter(full[slice(*plan.shard_range(r))].clone()) for r in range(world)]
    opts = [ShardOptimizer([p], kind) for p in shards]
    ref_p = torch.nn.Parameter(full.clone())
    ref = torch_optimizer(kind, [ref_p], hp)
    for g in grads:
        for r, (p, opt) in enumerate(zip(shards, opts)):
            p.grad = 2.0 * g[slice(*plan.shard_range(r))]  # e.g. a loss scale of 2 ...
            opt.step(hp, grad_scale=0.5)  # ... removed by grad_scale
        ref_p.grad = g.clone()
        ref.step()
    got = torch.cat([p.detach() for p in shards])
    assert torch.allclose(got, ref_p.detach(), rtol=1e-6, atol=1e-6), (got - ref_p).abs().max()
    assert not torch.equal(got, full)  # it did move


def test_fp16_shard_keeps_an_fp32_master():
    torch.manual_seed(2)
    w = torch.randn(6, 4)
    p16 = torch.nn.Parameter(w.half())
    opt = ShardOptimizer([p16], "adam")
    ref_p = torch.nn.Parameter(w.half().float())
    ref = torch_optimizer("adam", [ref_p])
    for _ in range(3):
        g = torch.randn(6, 4)
        p16.grad, ref_p.grad = g.half(), g.half().float()
        opt.step(HP)
        ref.step()
    assert opt.state[0]["master"].dtype == torch.float32 and opt.state[0]["exp_avg"].dtype == torch.float32
    assert torch.allclose(opt.state[0]["master"], ref_p.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(p16.detach(), ref_p.detach().half())


def test_kind_of_and_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert kind_of(torch.optim.Adam(p)) == "adam" and kind_of(torch.optim.AdamW(p)) == "adamw"
    assert kind_of(torch.optim.SGD(p, lr=0.1)) == "sgd"
    with pytest.raises(UnsupportedOptimizerError, match="amsgrad"):
        kind_of(torch.optim.Adam(p, amsgrad=True))
    with pytest.raises(UnsupportedOptimizerError, match="Adagrad is not supported"):
        kind_of(torch.optim.Adagrad(p))
    with pytest.raises(UnsupportedOptimizerError):
        ShardOptimizer(p, "lamb")
    with pytest.raises(RuntimeError, match="before begin_step"):
        ShardOptimizer(p, "sgd").apply()
    hp = HyperParams.from_param_group(torch.optim.SGD(p, lr=0.3, momentum=0.7, nesterov=True).param_groups[0])
    assert (hp.lr, hp.momentum, hp.nesterov) == (0.3, 0.7, True)


def test_full_state_dict_round_trip_without_a_table():
    p = torch.nn.Parameter(torch.randn(5, 2))
    opt = ShardOptimizer([p], "adam")
    p.grad = torch.randn(5, 2)
    opt.step(HP)
    sd = opt.full_state_dict()
    other = ShardOptimizer([torch.nn.Parameter(p.detach().clone())], "adam")
    other.load_full_state_dict(sd)
    assert other.step_count == 1 and torch.equal(other.state[0]["exp_avg"], opt.state[0]["exp_avg"])
    with pytest.raises(ValueError, match="is for 'adam', this run uses 'sgd'"):
        ShardOptimizer([p], "sgd").load_full_state_dict(sd)
