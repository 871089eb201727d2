"""What CPU can show of the GPU paths of the core: half-precision gradient rows are summed
in fp32 (no half-precision ``index_add_``, which on CUDA accumulates in half with atomics),
and the exchange forced on at world size one (``EMBRACE_FORCE_EXCHANGE``), the switch
``scripts/gpu_check.sh`` uses to put the AlltoAll path on an NCCL group of one GPU."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from embrace_fairseq import CommLedger, ShardedEmbedding
from embrace_fairseq.core import native_ops


class _IndexAddDtypes(TorchDispatchMode):
    """Records the destination dtype of every index_add the dispatcher sees."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "index_add" in str(func):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_are_summed_in_fp32(dtype, monkeypatch):
    monkeypatch.setenv("EMBRACE_NATIVE", "0")  # the reference path, as auto mode runs on CUDA
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(200, 8, generator=g) * 3).to(dtype)
    index = torch.randint(0, 5, (200,), generator=g)
    with _IndexAddDtypes() as mode:
        out = native_ops.scatter_add_rows(src, index, 5, scale=0.25)
    assert mode.dtypes and all(d == torch.float32 for d in mode.dtypes), mode.dtypes
    # scaled in fp32, then rounded once (an owner's sum over ranks may exceed the half range)
    want = torch.zeros(5, 8).index_add_(0, index, src.float()).mul_(0.25).to(dtype)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_expand_rows_backward_sums_in_fp32(dtype, monkeypatch):
    monkeypatch.setenv("EMBRACE_NATIVE", "0")
    rows = torch.randn(4, 6).to(dtype).requires_grad_()
    inverse = torch.tensor([0, 1, 1, 3, 3, 3, 0, 2] * 20)
    out = native_ops.expand_rows(rows, inverse)
    with _IndexAddDtypes() as mode:
        out.backward(torch.ones_like(out))
    assert mode.dtypes and all(d == torch.float32 for d in mode.dtypes), mode.dtypes
    counts = torch.bincount(inverse, minlength=4).to(dtype).unsqueeze(1).expand(4, 6)
    assert torch.equal(rows.grad, counts)


def test_forced_exchange_on_one_rank_equals_a_plain_embedding(gloo1):
    ledger = CommLedger()
    torch.manual_seed(3)
    emb = ShardedEmbedding(20, 4, padding_idx=1, force_exchange=True, ledger=ledger)
    assert emb.is_sharded and emb.world_size == 1
    ids = torch.tensor([[2, 5, 5, 1], [19, 0, 2, 7]])
    out = emb(ids)
    assert ledger.calls["ids"] == 1 and ledger.calls["rows"] == 1  # the exchange ran
    ref_w = emb.weight.detach().clone().requires_grad_()
    ref = F.embedding(ids, ref_w, padding_idx=1)
    assert torch.equal(out, ref)
    coef = torch.randn(*ids.shape, 4)
    (out * coef).sum().backward()
    (ref * coef).sum().backward()
    assert torch.allclose(emb.weight.grad, ref_w.grad)
    assert torch.equal(emb.full_weight(), emb.weight.detach())  # the full-table gather path too


def test_force_exchange_switch_reads_the_environment(gloo1, monkeypatch):
    monkeypatch.setenv("EMBRACE_FORCE_EXCHANGE", "1")
    assert ShardedEmbedding(10, 2).is_sharded
    monkeypatch.setenv("EMBRACE_FORCE_EXCHANGE", "0")
    assert not ShardedEmbedding(10, 2).is_sharded


def test_forcing_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    assert not ShardedEmbedding(10, 2, force_exchange=True).is_sharded  # a plain local table
