"""DeepSpeed on CPU without its shared-memory all-reduce.

On the CPU accelerator, DeepSpeed's comm layer JIT-compiles a shared-memory op when it
starts (``deepspeed.comm.torch.build_shm_op``) and every rank maps a 69 MB buffer,
``/dev/shm/deepspeed_allreduce_buffer_*``, that nothing unlinks: each CPU DeepSpeed job
leaves world-size x 69 MB of RAM behind until the machine restarts (a test suite, gigabytes).
The op serves DeepSpeed's ``inference_all_reduce`` only; training, stock or EmbRace,
reduces through ``torch.distributed``. Marking the op unavailable before the comm layer
starts skips the compile (and its lock, shared by every DeepSpeed process of the machine)
and the buffer; every collective a training step issues is unchanged.
"""
from __future__ import annotations

SHM_OP = "deepspeed_shm_comm"


def skip_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU comm layer from building its shared-memory op (idempotent;
    call before ``deepspeed.initialize`` / ``deepspeed.init_distributed``)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False
