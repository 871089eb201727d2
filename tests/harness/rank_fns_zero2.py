"""Per-rank bodies of the ZeRO stage-2 tests: stock DeepSpeed ZeRO-2 (replicated table)
against EmbRace at ZeRO-2 (sharded table, the shard optimizer), several engines per
spawned run (starting DeepSpeed dominates the cost of a run)."""
import logging

import torch

from embrace_fairseq.core.sharded_embedding import is_sharded_param
from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce
from rank_fns_deepspeed import BATCH, TinyLM, _batch, _ds_env

#: small buckets: DeepSpeed's hooks reduce-scatter several buckets during backward,
#: between the embedding's own exchanges (the tiny model has ~1.7k dense elements)
ZERO2 = {"stage": 2, "reduce_bucket_size": 600, "allgather_bucket_size": 600, "contiguous_gradients": True,
         "overlap_comm": False}


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=1e-3)


#: name -> (tied, gradient_clipping, gradient_accumulation_steps, client optimizer or None, extra config)
CASES = {
    # tied table (the output projection reads the gathered table), clipping active, accumulation 2
    "tied_clip_gas2": (True, 0.05, 2, _adam, {}),
    # untied, AdamW + warm-up schedule from the config (hyper-parameters read live by the shard optimizer)
    "untied_adamw_sched": (False, 0.05, 1, None, {
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}}}),
    # untied, SGD with momentum, clipping, accumulation 2
    "untied_sgd_gas2": (False, 0.05, 2, _sgd, {"zero_allow_untested_optimizer": True}),
    # tied without clipping (the unscale factor is 1: the shards get DeepSpeed's plain step)
    "tied_noclip": (True, 0.0, 1, _adam, {}),
}
#: bf16 (compared to bf16 rounding): DeepSpeed accumulates the bf16 gradients' partition in fp32
BF16_CASES = {
    "bf16_tied_clip_gas2": (True, 0.05, 2, _adam, {"bf16": {"enabled": True}}),
    "bf16_untied_clip": (False, 0.05, 1, _adam, {"bf16": {"enabled": True}}),
}
CASES.update(BF16_CASES)
FP32_CASES = [c for c in CASES if c not in BF16_CASES]


def _config(clip, gas, extra, stage=2):
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 10**9, "zero_optimization": dict(ZERO2, stage=stage)}
    cfg.update(extra)
    return cfg


def _kept_out(engine):
    """What DeepSpeed holds of the table shards: in its optimizer, with its gradient hooks."""
    zopt = engine.optimizer
    shards = [p for p in engine.module.parameters() if is_sharded_param(p)]
    held = {id(p) for g in zopt.bit16_groups for p in g}
    return {"shards": len(shards), "in_optimizer": sum(id(p) in held for p in shards),
            "hooked": sum(id(p) in zopt.param_id for p in shards),
            "dense_hooked": len(zopt.param_id), "partition_gradients": bool(zopt.partition_gradients),
            "hook_reducer": getattr(getattr(engine, "embrace", None), "reducer", "no hook")}


def train_case(rank, world, case, *, sharded, steps, stage=2):
    """``steps`` optimizer steps of one case; losses (every micro-step), full weights,
    DeepSpeed's global norm per step, and what DeepSpeed holds of the shards."""
    import deepspeed

    from embrace_fairseq.deepspeed_adapter import initialize

    tied, clip, gas, make_opt, extra = CASES[case]
    model = TinyLM(sharded, tied)
    opt = make_opt(model.parameters()) if make_opt is not None else None
    skip_shm_allreduce()  # no leaked /dev/shm buffer per rank
    init = initialize if sharded else deepspeed.initialize
    engine, *_ = init(model=model, optimizer=opt, model_parameters=list(model.parameters()),
                      config=_config(clip, gas, extra, stage))
    facts = _kept_out(engine)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(gas):
            ids, tgt = _batch(step * gas + micro, rank)
            loss = engine(ids, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    hook = getattr(engine, "embrace", None)
    if hook is not None:
        hook.close()
    return {"losses": losses, "norms": norms, "state": model.full_state(), "facts": facts}


def zero2_run(rank, world, cases, steps=4):
    """Stock DeepSpeed ZeRO-2 then EmbRace ZeRO-2 for every case; the log lines of the
    EmbRace engines (the 2D schedule says once that it does not apply), and the error a
    stage-3 config gets."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    keep = Keep()
    logging.getLogger("embrace_fairseq.deepspeed_adapter").addHandler(keep)
    logging.getLogger("embrace_fairseq.deepspeed_adapter").setLevel(logging.INFO)
    from embrace_fairseq.deepspeed_adapter import EmbraceConfigError, initialize

    res = {"stage3": None}
    try:  # refused before DeepSpeed starts, on every rank
        initialize(model=TinyLM(True, True), config=_config(0.0, 1, {}, stage=3))
    except EmbraceConfigError as exc:
        res["stage3"] = str(exc)
    for case in cases:
        for sharded in (False, True):
            res[(case, sharded)] = train_case(rank, world, case, sharded=sharded, steps=steps)
    res["log"] = [m for m in records if "2D schedule" in m]
    return res


def nonfinite_zero2_run(rank, world, where, nan_rank, bf16=False):
    """A NaN in one rank's gradient (``where``: "shard" or "dense") at the second step of
    ZeRO-2 training (fp32 or bf16, whose dense partition DeepSpeed keeps as one fp32
    buffer): every rank raises the same error before the step's update."""
    import deepspeed  # noqa: F401  (DeepSpeed's accelerator before the model)

    from embrace_fairseq.deepspeed_adapter import initialize
    from embrace_fairseq.optim.grad_norm import NonFiniteGradientError

    _ds_env(rank, world)
    torch.set_num_threads(1)
    model = TinyLM(True, False)
    skip_shm_allreduce()
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    engine, *_ = initialize(model=model, optimizer=_adam(model.parameters()), config=_config(0.05, 1, extra))
    target = model.emb.weight if where == "shard" else model.fc2.weight
    if rank == nan_rank:
        target.register_hook(lambda g: torch.full_like(g, float("nan")) if engine.global_steps == 1 else g)
    before = None
    try:
        for step in range(3):
            if step == 1:
                before = model.full_state()
            ids, tgt = _batch(step, rank)
            engine.backward(engine(ids, tgt))
            engine.step()
    except NonFiniteGradientError as exc:
        after = model.full_state()
        unchanged = all((before[k] == after[k]).all() for k in before)
        return {"error": str(exc), "isfpe": isinstance(exc, FloatingPointError), "unchanged": bool(unchanged)}
    return {"error": None}


def relaxed_zero2_run(rank, world, steps=5):
    """The relaxed embedding dependency at ZeRO-2 (untied and tied, next-batch ids given)
    against stock DeepSpeed (stage 0, the same math): losses and full weights."""
    import rank_fns_deepspeed as R

    _ds_env(rank, world)
    torch.set_num_threads(1)
    relaxed = dict(R.PIECES, relaxed_embedding=True)
    out = {}
    for tied in (False, True):
        out[("stock", tied)] = R._train_relaxed(rank, world, sharded=False, tied=tied, steps=steps)
        out[("relaxed", tied)] = R._train_relaxed(rank, world, sharded=True, tied=tied, steps=steps, embrace=relaxed,
                                                  stage=2)
    return out
