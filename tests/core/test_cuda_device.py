"""The CUDA device a rank's collectives use (core/cuda_device.py): the choice from
LOCAL_RANK as a pure function, the refusal of two ranks on one GPU from identities
exchanged through the default group's store (real gloo ranks), and nothing done on a
machine without CUDA. The device-side half runs in scripts/gpu_check.sh."""
import pytest
import torch

from embrace_fairseq.core import cuda_device as D
from embrace_fairseq.core.errors import UserError
from embrace_fairseq.tools.local_ranks import run_ranks

import rank_fns_cuda_device as fns


@pytest.mark.parametrize("current,count,local_rank,bound,want", [
    (0, 8, 3, None, 3),      # nothing set it: the launcher's local rank
    (0, 8, 0, None, None),   # already the local rank's device
    (5, 8, 3, None, None),   # the caller set another device: it stays
    (0, 8, None, None, None),  # no launcher variable: left alone
    (0, 1, 3, None, None),   # one visible device per rank
    (0, 8, 3, 6, 6),         # a process group bound to a device: that one
    (6, 8, 3, 6, None),
    (0, 0, 3, None, None),   # no CUDA device
])
def test_device_choice(current, count, local_rank, bound, want):
    assert D.choose_device(current, count, local_rank, bound) == want


def test_more_local_ranks_than_gpus_is_a_user_error():
    with pytest.raises(UserError, match="LOCAL_RANK=9 but this process sees 8 GPUs"):
        D.choose_device(0, 8, 9)


def test_refusal_names_every_pair_of_ranks_on_one_gpu():
    D.refuse_shared_gpus(["GPU-a", "GPU-b", "GPU-c"])
    with pytest.raises(D.SharedGpuError, match=r"^ranks 0 and 2 both drive GPU-a; ranks 1 and 3 both drive GPU-b: NCCL"):
        D.refuse_shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-b"])
    assert issubclass(D.SharedGpuError, UserError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_no_cuda_no_device_and_no_exchange():
    assert D.ensure_device() is None


def test_every_rank_refuses_a_shared_gpu_and_distinct_gpus_pass():
    """Three gloo ranks exchange (made-up) GPU identities through the real store: with
    ranks 0 and 2 on one GPU every rank stops with the same one-line error (none waits in
    a collective for the others); with three GPUs none does."""
    shared = ["GPU-x", "GPU-y", "GPU-x"]
    for seen, message in run_ranks(fns.shared_gpu_refusal, 3, shared, timeout_s=60):
        assert seen == shared and message.startswith("ranks 0 and 2 both drive GPU-x:") and "\n" not in message
    distinct = ["GPU-x", "GPU-y", "GPU-z"]
    assert run_ranks(fns.shared_gpu_refusal, 3, distinct, timeout_s=60) == [(distinct, "")] * 3
