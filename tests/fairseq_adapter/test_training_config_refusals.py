"""fairseq flags EmbRace cannot train with are refused at start-up as user errors: one line
naming the flag and what to do, not a traceback; a model without sharded tables keeps
stock fairseq's behaviour."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fairseq")

from embrace_fairseq import ShardedEmbedding  # noqa: E402
from embrace_fairseq.fairseq_adapter.trainer_glue import (  # noqa: E402
    UnsupportedTrainingConfig,
    validate_training_config,
)
from embrace_fairseq.guards.one_line_errors import one_line, user_error_of  # noqa: E402


def _cfg(cpu=False, fp16=False, memory_efficient_fp16=False, bf16=False, memory_efficient_bf16=False,
         ddp_backend="legacy_ddp", amp=False, no_flatten=False):
    common = SimpleNamespace(cpu=cpu, fp16=fp16, amp=amp, memory_efficient_fp16=memory_efficient_fp16,
                             bf16=bf16, memory_efficient_bf16=memory_efficient_bf16, fp16_no_flatten_grads=no_flatten)
    return SimpleNamespace(common=common, distributed_training=SimpleNamespace(ddp_backend=ddp_backend))


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = ShardedEmbedding(11, 4, force_exchange=True)  # sharded on a world of one
    assert model.embed.is_sharded
    return model


@pytest.mark.parametrize("cfg, sharded, says", [
    (_cfg(cpu=True, fp16=True, amp=True), True, "--amp needs a CUDA device"),
    (_cfg(cpu=True, fp16=True), False, "--fp16 on CPU (--cpu) needs --fp16-no-flatten-grads"),
    (_cfg(ddp_backend="fully_sharded"), True, "--ddp-backend fully_sharded is not supported with EmbRace architectures"),
])
def test_each_refusal_is_one_line(world_of_one, cfg, sharded, says):
    with pytest.raises(UnsupportedTrainingConfig) as info:
        validate_training_config(cfg, _sharded_model() if sharded else torch.nn.Linear(2, 2))
    assert user_error_of(info.value) is info.value and isinstance(info.value, ValueError)
    line = one_line(info.value)
    assert line.startswith("embrace: error: UnsupportedTrainingConfig: ") and says in line, line


def test_what_can_run_is_accepted(world_of_one):
    validate_training_config(_cfg(fp16=True, memory_efficient_fp16=True), _sharded_model())
    # fairseq's FP16Optimizer, its fp32 copies per parameter for these models (fp16_masters.py)
    validate_training_config(_cfg(fp16=True), _sharded_model())
    validate_training_config(_cfg(cpu=True, fp16=True), _sharded_model())
    validate_training_config(_cfg(cpu=True, fp16=True, no_flatten=True), torch.nn.Linear(2, 2))
    validate_training_config(_cfg(ddp_backend="c10d"), _sharded_model())
    # no sharded table: fairseq's own rules apply (its FP16Optimizer, any backend)
    validate_training_config(_cfg(fp16=True, ddp_backend="fully_sharded"), torch.nn.Linear(2, 2))
