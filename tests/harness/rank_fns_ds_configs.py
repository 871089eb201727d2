"""Rank bodies for the shipped DeepSpeed configs: each CPU config trains the tiny model."""
import copy
import json
import os

import torch

import rank_fns_deepspeed as R
from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce


def train_with_config(rank, world, path, steps, trace_dir):
    """``steps`` steps of the tiny tied model with the config at ``path``: EmbRace's hook
    when the file has an "embrace" section, stock DeepSpeed otherwise; and the same steps
    with stock DeepSpeed on the file without its "embrace" section, as the reference."""
    import deepspeed

    from embrace_fairseq.deepspeed_adapter import initialize

    R._ds_env(rank, world)
    cfg = json.loads(open(path).read())
    if (cfg.get("embrace") or {}).get("trace"):
        cfg["embrace"]["trace"] = os.path.join(trace_dir, "trace")
    out = {}
    for sharded in (False, True) if "embrace" in cfg else (False,):
        run_cfg = copy.deepcopy(cfg)
        if not sharded:
            run_cfg.pop("embrace", None)
        model = R.TinyLM(sharded, tied=True)
        skip_shm_allreduce()
        # a config without an optimizer section trains with the client Adam of the other tests
        opt = None if "optimizer" in run_cfg else torch.optim.Adam(model.parameters(), lr=1e-2)
        init = initialize if sharded else deepspeed.initialize
        engine, *_ = init(model=model, optimizer=opt, model_parameters=list(model.parameters()), config=run_cfg)
        gas = engine.gradient_accumulation_steps()
        losses = []
        for step in range(steps * gas):
            ids, tgt = R._batch(step, rank)
            loss = engine(ids, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        hook = getattr(engine, "embrace", None)
        if hook is not None:
            hook.close()
        out[sharded] = {"losses": losses, "state": model.full_state(), "steps": engine.global_steps}
    return out
