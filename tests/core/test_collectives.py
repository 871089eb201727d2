"""embrace_fairseq.core.collectives: the placement rule per backend (a pure function, no GPU
needed), and every wrapper on a real one-rank gloo group in this process."""

import pytest
import torch
import torch.distributed as dist

from embrace_fairseq.core import collectives as C

CPU = torch.device("cpu")
CUDA1 = torch.device("cuda", 1)


# --------------------------------------------------------------------------- placement rule
@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
@pytest.mark.parametrize("device", [CPU, torch.device("cuda", 0), CUDA1])
def test_nccl_takes_the_current_cuda_device(backend, device):
    assert C.placement(backend, device, 3) == torch.device("cuda", 3)


def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="NCCL process group needs a CUDA device"):
        C.placement("nccl", CPU, None)


@pytest.mark.parametrize("device", [CPU, CUDA1])
def test_gloo_takes_cpu_or_cuda_as_given(device):
    assert C.placement("gloo", device, 0) == device
    assert C.placement("gloo", device, None) == device


def test_gloo_moves_other_devices_to_cpu():
    assert C.placement("gloo", torch.device("meta"), None) == CPU


@pytest.mark.parametrize("backend", ["mpi", "ucc", "my_custom_backend", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("device", [CPU, CUDA1])
def test_other_backends_take_tensors_as_given(backend, device):
    assert C.placement(backend, device, 0) == device


# --------------------------------------------------------------------------- one-rank gloo group
def test_sync_wrappers_on_gloo(gloo1):
    assert C.is_distributed() and C.world_size() == 1 and C.rank() == 0 and C.backend_name() == "gloo"
    assert C.device_for(None, "cpu") == CPU
    t = torch.tensor([1.0, 2.0])
    assert C.all_reduce(t) is t and t.tolist() == [1.0, 2.0]
    assert C.all_reduce(torch.tensor([5]), op="max").tolist() == [5]
    (g,) = C.all_gather(torch.arange(3))
    assert g.tolist() == [0, 1, 2]
    assert C.all_gather_object({"a": 1}) == [{"a": 1}]
    out = torch.empty(4, dtype=torch.long)
    assert C.all_to_all_single(out, torch.arange(4), [4], [4]).tolist() == [0, 1, 2, 3]
    C.barrier()
    assert not C.issues_from_one_thread()


def test_async_wrappers_give_results_and_times(gloo1):
    p = C.all_reduce_async(torch.ones(3))
    assert p.wait().tolist() == [1.0, 1.0, 1.0]
    p.synchronize()
    assert p.done() and p.end_us() >= p.issued_us
    parts = C.all_gather_async(torch.arange(2)).wait()
    assert [x.tolist() for x in parts] == [[0, 1]]
    out = torch.empty(2)
    assert C.all_to_all_single_async(out, torch.tensor([3.0, 4.0]), [2], [2]).wait().tolist() == [3.0, 4.0]


def test_new_group_is_created_and_warmed_up(gloo1, monkeypatch):
    calls = []
    real = C.all_reduce
    monkeypatch.setattr(C, "all_reduce", lambda t, op="sum", group=None: calls.append(group) or real(t, op, group))
    g = C.new_group()
    assert g is not None and calls == [g]  # one collective on the new group, at creation


def test_rows_of_a_table_and_their_autograd(gloo1):
    shard = torch.randn(5, 3, requires_grad=True)
    full = C.gather_rows_from_group(shard, [5], scale=0.5)
    assert torch.equal(full, shard.detach())
    seen = []
    full = C.gather_rows_from_group(shard, [5], scale=0.5, on_backward=seen.append)
    (full * 2).sum().backward()
    assert len(seen) == 1 and torch.equal(shard.grad, torch.ones(5, 3))  # 2 * 0.5
    assert torch.equal(C.reduce_scatter_rows(torch.ones(5, 3), [5]), torch.ones(5, 3))
    assert C.all_gather_rows(torch.ones(2, 3), [2]).shape == (2, 3)


def test_without_torch_distributed_world_is_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    assert not C.is_distributed() and C.world_size() == 1 and C.rank() == 0 and C.new_group() is None
