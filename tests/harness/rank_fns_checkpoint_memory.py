"""Per-rank body of the checkpoint-memory test (spawned in real gloo ranks): what each
rank receives of the other ranks' state while a ZeRO checkpoint is gathered."""
import types

import torch
import torch.distributed.distributed_c10d as c10d

from rank_fns_deepspeed import TinyLM, _batch, _ds_config, _ds_env


def save_receipts(rank, world, stages=(1, 2)):
    """Per ZeRO stage (engines built one after the other: starting DeepSpeed dominates a
    spawn), :func:`_receipts`."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    return {stage: _receipts(rank, stage) for stage in stages}


def _receipts(rank, stage):
    """ZeRO ``stage``, one step, then the save's gather (:func:`gather_full_state`):
    the bytes this rank deserialised from object collectives during it (torch's own
    ``_tensor_to_object``, wrapped to count and call through), and what the writer got."""
    from embrace_fairseq.deepspeed_adapter import checkpoint as ck
    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(True, True)
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                            model_parameters=list(model.parameters()), config=_ds_config(stage=stage))
    engine.backward(engine(*_batch(0, rank)))
    engine.step()
    own = len(ck._blob(engine.optimizer.state_dict()))
    received = []
    original = c10d._tensor_to_object

    def counting(tensor, tensor_size, group):
        received.append(int(tensor_size))
        return original(tensor, tensor_size, group)

    c10d._tensor_to_object = counting
    try:
        full = ck.gather_full_state(types.SimpleNamespace(embrace=engine.embrace, optimizer=engine.optimizer), model)
    finally:
        c10d._tensor_to_object = original
    out = {"received": sum(received), "own_state_bytes": own, "full": full is not None}
    if full is not None:
        per_rank = full["optimizer"]["dense_per_rank"]
        out["per_rank_states"] = len(per_rank)
        out["per_rank_bytes"] = [len(b) for b in per_rank]
        out["rng_states"] = len(full["rng"])
        # the writer's blobs are every rank's own: ZeRO loads them back as a list
        out["states_load"] = all(isinstance(ck._unblob(b), dict) for b in per_rank)
    return out
