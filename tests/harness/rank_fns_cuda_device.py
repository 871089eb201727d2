"""Per-rank body of the shared-GPU refusal test (spawned in real gloo ranks)."""
import torch.distributed as dist


def shared_gpu_refusal(rank, world, identities):
    """Each rank publishes ``identities[rank]`` in the default group's store, reads every
    rank's, and applies the refusal: the message it stops with, or "" (then a collective
    still runs: nothing was left half-done)."""
    from embrace_fairseq.core import collectives
    from embrace_fairseq.core.cuda_device import SharedGpuError, exchange_identities, refuse_shared_gpus

    seen = exchange_identities(identities[rank], dist.distributed_c10d._get_default_store(), rank, world,
                               prefix="test/cuda_device/")
    try:
        refuse_shared_gpus(seen)
    except SharedGpuError as exc:
        return seen, str(exc)
    collectives.barrier()
    return seen, ""
