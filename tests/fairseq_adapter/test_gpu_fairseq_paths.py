"""The fairseq adapter's GPU-facing paths that CPU can show: resuming with
--memory-efficient-fp16/bf16 (fairseq's loader copies the moments back after the sliced
load), checkpoint loads with weights_only=True (a malicious pickle is refused unrun, even
with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), no full copies kept after a save, and sidecars of
checkpoints removed by --keep-* removed too."""
import gc
import os
import time
import types
import weakref

import pytest
import torch

pytest.importorskip("fairseq")

import embrace_fairseq.fairseq_adapter  # noqa: E402,F401  (applies the hooks)
from embrace_fairseq import ShardedEmbedding  # noqa: E402
from embrace_fairseq.fairseq_adapter import checkpoint_io, trainer_glue  # noqa: E402
from embrace_fairseq.guards.atomic_io import atomic_save  # noqa: E402
from embrace_fairseq.guards.safe_load import UnsafeCheckpointError  # noqa: E402


class _FakeTable:
    """Rows 0..2 of a 6-row table: what table_of() of a rank-0 shard returns."""

    num_embeddings = 6

    def shard_of(self, full):
        return full[0:3]


def _mem_efficient(dtype):
    from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
    from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
    from omegaconf import OmegaConf

    table = _FakeTable()
    p = torch.nn.Parameter(torch.randn(3, 4).to(dtype))
    p.embrace_sharded = True
    p._embrace_table = weakref.ref(table)
    inner = FairseqAdam(OmegaConf.structured(FairseqAdamConfig(lr=[0.01], tpu=False)), [p])
    cfg = OmegaConf.create({
        "common": {"fp16_scale_window": 128, "fp16_init_scale": 128, "fp16_scale_tolerance": 0.0,
                   "threshold_loss_scale": None, "min_loss_scale": 1e-4, "bf16": dtype == torch.bfloat16,
                   "model_parallel_size": 1},
        "optimization": {"update_freq": [1]}, "distributed_training": {"distributed_world_size": 1}})
    return MemoryEfficientFP16Optimizer(cfg, [p], inner), p, table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_memory_efficient_resume_keeps_this_ranks_moments(dtype):
    opt, p, table = _mem_efficient(dtype)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    full = {k: torch.arange(24, dtype=torch.float32).view(6, 4) + i for i, k in enumerate(("exp_avg", "exp_avg_sq"))}
    for entry in saved["state"].values():
        entry.update({k: v.clone() for k, v in full.items()})  # as a world-size-free checkpoint holds them
    opt2, p2, _ = _mem_efficient(dtype)
    opt2.load_state_dict(saved)
    state = next(iter(opt2.optimizer.state.values()))
    assert state["exp_avg"].shape == (3, 4) and state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg_sq"], full["exp_avg_sq"][0:3])
    p2.grad = torch.ones_like(p2)
    opt2.step()  # a shape mismatch before the fix


def _evil(path, marker):
    class Payload:
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    torch.save({"model": {}, "extra_state": Payload()}, path)


@pytest.mark.parametrize("force_env", [False, True])
def test_fairseq_checkpoint_load_refuses_code(tmp_path, monkeypatch, force_env):
    from fairseq import checkpoint_utils

    if force_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "code_ran"
    ckpt = tmp_path / "checkpoint_last.pt"
    _evil(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match="nothing in it was executed"):
        checkpoint_utils.load_checkpoint_to_cpu(str(ckpt))
    assert not marker.exists()


def test_keep_cleanup_leaves_no_orphan_sidecar(tmp_path):
    for name in ("checkpoint_1_10.pt", "checkpoint_1_20.pt"):
        atomic_save({"w": torch.zeros(1)}, str(tmp_path / name))

    def fairseq_save(cfg, trainer, epoch_itr, val_loss):  # its --keep-interval-updates 1 cleanup
        os.remove(tmp_path / "checkpoint_1_10.pt")

    trainer = types.SimpleNamespace(should_save_checkpoint_on_current_rank=True, model=torch.nn.Linear(1, 1))
    checkpoint_io._wrap_save_checkpoint(fairseq_save)(types.SimpleNamespace(save_dir=str(tmp_path)), trainer, None, None)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_20.pt", "checkpoint_1_20.pt.sha256"]


V, D = 37, 5


def _full_size_tensors(allowed, settle_s=5.0):
    """Full-size tensors other than ``allowed`` still alive. A collective's completion
    callback runs on gloo's thread and holds the finished future (and its gathered
    output) until it returns, a moment after the waiter woke: such a reference is let go
    within ``settle_s``; one that is still there after it is a real leak."""
    keep = {t.data_ptr() for t in allowed}
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        found = [o for o in gc.get_objects()
                 if torch.is_tensor(o) and tuple(o.shape) == (V, D) and o.data_ptr() not in keep]
        if not found or time.monotonic() > deadline:
            return found
        del found
        time.sleep(0.05)


@pytest.mark.parametrize("writer", [True, False])
def test_no_full_copy_is_kept_after_a_save(gloo1, tmp_path, writer):
    model = torch.nn.Module()
    model.emb = ShardedEmbedding(V, D, force_exchange=True)  # a table whose save gathers
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.emb(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    trainer = types.SimpleNamespace(model=model, optimizer=opt, should_save_checkpoint_on_current_rank=writer,
                                    always_call_state_dict_during_save_checkpoint=False,
                                    cfg=types.SimpleNamespace(checkpoint=types.SimpleNamespace(
                                        no_save_optimizer_state=False)))
    state_dict = trainer_glue._state_dict(
        lambda self: {"model": self.model.state_dict(), "last_optimizer_state": self.optimizer.state_dict()})

    def fairseq_trainer_save(self, filename, extra_state):
        torch.save(state_dict(self), filename)

    trainer_glue._consolidate_optimizer(lambda self: None)(trainer)
    if writer:
        trainer_glue._save_checkpoint(fairseq_trainer_save)(trainer, str(tmp_path / "c.pt"), {})
        saved = torch.load(tmp_path / "c.pt")
        assert saved["model"]["emb.weight"].shape == (V, D)
        assert saved["last_optimizer_state"]["state"][0]["exp_avg"].shape == (V, D)
        del saved
    st = opt.state[model.emb.weight]
    leaks = _full_size_tensors([model.emb.weight, model.emb.weight.grad, st["exp_avg"], st["exp_avg_sq"]])
    assert not leaks, f"{len(leaks)} full-size tensors still referenced after the save"
