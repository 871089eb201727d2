"""embrace-ds-train's checkpoint paths: weights_only loads (a malicious pickle, in the file or
in the bytes it carries, is refused unrun; DeepSpeed's and numpy's resume state loads), no
full copy kept by a rank after a save, and DeepSpeed's fp32 masters (bf16 ZeRO-1) and the
shard optimizer's refreshed after weights are loaded without optimizer state."""
import os

import pytest
import torch

pytest.importorskip("deepspeed")

from embrace_fairseq.deepspeed_adapter import checkpoint as ck  # noqa: E402
from embrace_fairseq.guards.safe_load import UnsafeCheckpointError  # noqa: E402
from embrace_fairseq.tools.local_ranks import run_ranks  # noqa: E402


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_launcher_load_refuses_a_malicious_checkpoint(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "extra_state": {"embrace_ds": Payload(str(marker))}}, path)
    with pytest.raises(UnsafeCheckpointError, match="nothing in it was executed"):
        ck.load_checkpoint(str(path), engine=None, model=None)
    with pytest.raises(UnsafeCheckpointError):
        ck._unblob(ck._blob({"rng": Payload(str(marker))}))  # resume bytes inside a good file
    assert not marker.exists()


def test_resume_state_loads_weights_only():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"rng": ck._rng_state(), "scaler": DynamicLossScaler(init_scale=2.0**8, scale_window=10, min_scale=1.0, delayed_shift=1,
                                                                  consecutive_hysteresis=False),
             "static": LossScaler(4.0), "mappings": [{"emb.weight": fragment_address(numel=4, start=0)}],
             "zero_stage": ZeroStageEnum.optimizer_states}
    back = ck._unblob(ck._blob(state))
    assert back["scaler"].cur_scale == 2.0**8 and back["static"].cur_scale == 4.0
    assert back["mappings"][0]["emb.weight"].numel == 4 and back["zero_stage"] == ZeroStageEnum.optimizer_states
    ck._set_rng_state(back["rng"])


def masters_after_weights_only_load(rank, world):
    """bf16 ZeRO-1: train 2 steps, load the initial weights (no optimizer state), one step
    with lr 0: the weights must stay the loaded ones (stale masters wrote the trained ones
    back); then a save drops every full copy on every rank."""
    import gc
    import types

    from rank_fns_deepspeed import TinyLM, _batch, _ds_config, _ds_env

    from embrace_fairseq.core.sharded_embedding import consolidate, release_consolidated
    from embrace_fairseq.deepspeed_adapter import initialize

    _ds_env(rank, world)
    torch.set_num_threads(1)
    model = TinyLM(True, True)
    cfg = dict(_ds_config(stage=1), bf16={"enabled": True})
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                            model_parameters=list(model.parameters()), config=cfg)
    consolidate(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    release_consolidated(model)
    for step in range(2):
        engine.backward(engine(*_batch(step, rank)))
        engine.step()
    model.load_state_dict(initial)  # a weights-only checkpoint
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    engine.backward(engine(*_batch(5, rank)))
    engine.step()
    consolidate(model)
    after = model.state_dict()
    diff = max(float((after[k].float() - initial[k].float()).abs().max()) for k in initial)
    release_consolidated(model)
    del initial, after
    # the save's gather: only rank 0 gets the full state, nobody keeps the tables after
    full = ck.gather_full_state(types.SimpleNamespace(embrace=engine.embrace, optimizer=engine.optimizer), model)
    del full
    gc.collect()
    vocab, dim = model.emb.num_embeddings, model.emb.embedding_dim
    kept = [o for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == (vocab, dim)]
    return {"diff": diff, "full_tables_kept": len(kept), "consolidated": model.emb._consolidated is not None}


@pytest.mark.slow
def test_masters_refreshed_and_no_full_copy_kept():
    res = run_ranks(masters_after_weights_only_load, 2, timeout_s=600, pg_timeout_s=300)
    for r in res:
        assert r["diff"] == 0.0, r
        assert r["full_tables_kept"] == 0 and not r["consolidated"], r
