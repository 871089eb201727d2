"""embrace_fairseq.core.collectives (and what it re-exports from core/backends.py and
core/pending.py): the backends by the group's configuration and the placement rule (pure
functions, no GPU needed), every wrapper on a real one-rank gloo group in this process,
and the lifetime of an asynchronous collective's tensors (real gloo ranks)."""

import pytest
import torch
import torch.distributed as dist

from embrace_fairseq.core import backends
from embrace_fairseq.core import collectives as C

CPU = torch.device("cpu")
CUDA1 = torch.device("cuda", 1)


# --------------------------------------------------------------------------- placement rule
@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
@pytest.mark.parametrize("device", [torch.device("cuda", 0), CUDA1])
def test_nccl_keeps_a_cuda_tensor_on_its_own_device(backend, device):
    # not the current device: a model built before the launcher set it would stage
    # every local rank's tensors on cuda:0
    assert C.placement(backend, device, 3) == device


@pytest.mark.parametrize("backend", ["nccl", "NCCL"])
@pytest.mark.parametrize("device", [CPU, torch.device("cuda")])
def test_nccl_stages_other_tensors_on_the_current_cuda_device(backend, device):
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


@pytest.mark.parametrize("backend", ["mpi", "ucc", "my_custom_backend"])
@pytest.mark.parametrize("device", [CPU, CUDA1])
def test_other_backends_take_tensors_as_given(backend, device):
    assert C.placement(backend, device, 0) == device


# --------------------------------------------------------------------------- backends by exact name
def test_backend_tables_are_what_torch_builds():
    assert C.backend_table("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert C.backend_table("nccl") == {"cuda": "nccl"}
    assert C.backend_table("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    # a bare init_process_group(): only the accelerator's default backend
    assert C.backend_table("undefined", cuda_available=True) == {"cuda": "nccl"}
    assert C.backend_table("undefined", cuda_available=False) == {"cpu": "gloo"}


def test_per_device_backend_runs_cuda_tensors_on_nccl():
    # CUDA tensors go to NCCL (on their own device), CPU tensors stay for gloo
    assert C.placement("cpu:gloo,cuda:nccl", CUDA1, 0) == CUDA1
    assert C.placement("cpu:gloo,cuda:nccl", CPU, 0) == CPU
    assert C._resolve(C.backend_table("cpu:gloo,cuda:nccl"), CUDA1, 0)[0] == "nccl"
    assert C._resolve(C.backend_table("cpu:gloo,cuda:nccl"), CPU, 0)[0] == "gloo"


@pytest.mark.parametrize("config", ["undefined", "cuda:nccl"])
def test_bare_init_on_a_gpu_machine_stages_cpu_tensors(config):
    # what a bare init_process_group() builds with a GPU: NCCL only, so a CPU tensor is staged
    assert C.placement(config, CPU, 2) == torch.device("cuda", 2)
    with pytest.raises(RuntimeError, match="NCCL process group needs a CUDA device"):
        C.placement("cuda:nccl", CPU, None)


def test_one_answer_for_which_backend_runs_a_tensor(gloo1, monkeypatch):
    # the group's configuration decides, not its name: the per-device NCCL configuration
    # is seen as NCCL for CUDA tensors, so the dense all-reduce issues from one thread
    monkeypatch.setattr(C.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(backends, "_cuda_index", lambda: 0)
    assert C.backend_for(None, "cuda") == "nccl" and C.issues_from_one_thread(None, "cuda")
    assert C.backend_for(None, "cpu") == "gloo" and not C.issues_from_one_thread(None, "cpu")
    assert C.device_for(None, CUDA1) == CUDA1 and C.device_for(None, "cuda") == torch.device("cuda", 0)


def test_single_thread_switch(gloo1, monkeypatch):
    assert not C.issues_from_one_thread(None, "cpu")
    monkeypatch.setenv("EMBRACE_SINGLE_THREAD_ISSUE", "1")
    assert C.issues_from_one_thread(None, "cpu")


def test_bare_init_process_group_is_resolved(tmp_path):
    """A real ``init_process_group()`` without a backend: torch calls it "undefined" and
    builds the accelerator's backend only: gloo on a CPU machine; NCCL on a GPU machine,
    where a CPU tensor's collective is staged onto the current GPU and issued in one order
    (the failing assumption "gloo here" was found running the suite on a GPU machine).
    Collectives and new groups work."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    want = ("nccl", torch.device("cuda", 0)) if cuda else ("gloo", CPU)
    dist.init_process_group(init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        assert C.backend_name() == "undefined"
        assert (C.backend_for(None, "cpu"), C.device_for(None, "cpu")) == want
        assert C.issues_from_one_thread(None, "cpu") == cuda
        assert C.all_reduce(torch.tensor([2.0])).tolist() == [2.0]
        g = C.new_group()
        assert C.backend_for(g, "cpu") == want[0]
        C.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- one-rank gloo group
def test_sync_wrappers_on_gloo(gloo1):
    assert C.is_distributed() and C.world_size() == 1 and C.rank() == 0 and C.backend_name() == "gloo"
    assert C.backend_for(None, "cpu") == "gloo"
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


# --------------------------------------------------------------------------- lifetimes
def test_pending_holds_what_the_collective_uses_until_wait(gloo1):
    """The rule itself, on a work that holds nothing (as NCCL's after its first wait)."""
    import gc
    import weakref

    buf = torch.ones(3)
    ref = weakref.ref(buf)
    work = C._FutureWork()
    p = C.Pending(lambda: work, CPU, lambda: None, keep=(buf,))
    del buf
    gc.collect()
    assert ref() is not None, "a tensor of a collective in flight was released before wait()"
    work.future.set_result(None)
    p.wait()
    gc.collect()
    assert ref() is None, "the tensor was still held after wait()"


def test_async_inputs_live_until_wait_on_real_ranks():
    """Inputs no caller holds stay alive until wait() and go after it. The same ranks
    also check the dense all-reduce's fp16 headroom (tests/schedule/test_fp16_headroom.py:
    one start-up of ranks for both)."""
    from embrace_fairseq.tools.local_ranks import run_ranks

    import rank_fns_collectives

    value = 40000.0  # two ranks: the sum 80000 is inf in fp16, the average 40000 is exact
    out = run_ranks(rank_fns_collectives.lifetimes_and_fp16, 2, value)
    for r in out:
        assert r["before"] == r["count"], r  # every input alive while in flight
        assert r["after"] == 0, r  # released once waited for
        assert r["results_ok"], r
        assert r["grad"] == [value] * 8, f"fp16 gradients summed before their division overflow: {r['grad']}"



def test_cpu_times_stay_host_times(gloo1):
    # on CPU a collective's issue time is the host's and its end comes from the work's
    # future; device events are for CUDA only
    p = C.all_reduce_async(torch.ones(2))
    p.wait()
    assert p.issued_us == p.host_issued_us <= p.end_us()
    assert p.done() and not p._keep and p._finish is None  # nothing held after wait()
