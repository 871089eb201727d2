"""Per-rank bodies of the DeepSpeed hook tests (spawned in real gloo ranks).

One spawned run trains several engines one after the other (stock DeepSpeed with a
replicated table, EmbRace variants with a sharded one), because importing and
starting DeepSpeed dominates the cost of a run.
"""
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq import ShardedEmbedding, fairseq_initial_table
from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce

VOCAB, DIM, HIDDEN, BATCH, SEQ = 37, 16, 32, 4, 6


def _ds_env(rank, world):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")


class TinyLM(nn.Module):
    """embedding -> 2 linear layers -> tied or untied output projection."""

    def __init__(self, sharded: bool, tied: bool, vocab: int = VOCAB):
        super().__init__()
        torch.manual_seed(1234)
        self.vocab = vocab
        if sharded:
            self.emb = ShardedEmbedding(vocab, DIM, padding_idx=1)
        else:  # same RNG draws as ShardedEmbedding's initial table
            self.emb = nn.Embedding(vocab, DIM, padding_idx=1, _weight=fairseq_initial_table(vocab, DIM, 1))
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.tied = tied
        self.sharded = sharded
        if not tied:
            self.out = nn.Linear(DIM, vocab)

    def forward(self, ids, target):
        h = self.fc2(torch.tanh(self.fc1(self.emb(ids))))
        if self.tied:
            w = self.emb.gathered_weight() if self.sharded else self.emb.weight
            logits = h @ w.t()
        else:
            logits = self.out(h)
        return F.cross_entropy(logits.reshape(-1, self.vocab), target.reshape(-1))

    def full_state(self):
        # numpy, not tensors: tensors cross the result queue as shared memory that
        # vanishes with the rank process
        out = {}
        for name, p in self.named_parameters():
            t = self.emb.full_weight() if (self.sharded and p is self.emb.weight) else p.detach()
            out[name] = t.float().numpy().copy()  # numpy has no bf16
        return out


def _batch(step, rank, vocab=VOCAB):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _ds_config(gas=1, clip=0.05, embrace=None, stage=0):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    if embrace is not None:
        cfg["embrace"] = embrace
    return cfg


def train(rank, world, *, sharded, tied, steps, gas=1, embrace=None, slow_rank=None, slow_s=0.0, clip=0.05):
    """Train ``steps`` optimizer steps; return losses, full weights and the trace summary."""
    import deepspeed

    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(sharded, tied)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if rank == slow_rank:
        # a slow rank: its hook on a middle layer sleeps in every backward
        model.fc1.weight.register_post_accumulate_grad_hook(lambda p: time.sleep(slow_s))
    if sharded:
        engine, *_ = initialize(model=model, optimizer=opt, config=_ds_config(gas, clip=clip, embrace=embrace or {}))
    else:
        skip_shm_allreduce()  # no leaked /dev/shm buffer per rank
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(gas, clip=clip))
    losses = []
    for step in range(steps):
        for micro in range(gas):
            ids, tgt = _batch(step * gas + micro, rank)
            loss = engine(ids, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    hook = getattr(engine, "embrace", None)
    summary = hook.summary() if hook is not None else None
    if hook is not None:
        hook.close()
    return {"losses": losses, "state": model.full_state(), "summary": summary,
            "schedule": [(p.bucket, p.index) for p in hook.schedule.issue_order] if hook else None,
            "next_forward": hook is not None and hook.next_forward is not None,
            "gate": hook is not None and hook.gate is not None,
            "node_aware": hook is not None and any(t.node_aware for t in hook.tables)}


def gate_choices(rank, world):
    """Whether the hook built the exchange gate and next-forward overlap, per "embrace"
    section and gradient clipping (one step each)."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    cases = [({}, 0.0), ({"next_forward": True}, 0.0), ({"exchange_gate": True}, 0.0),
             ({"next_forward": True, "exchange_gate": True}, 0.0), ({"next_forward": True, "exchange_gate": True}, 0.05)]
    out = []
    for embrace, clip in cases:
        res = train(rank, world, sharded=True, tied=False, steps=1, embrace=dict(PIECES, **embrace), clip=clip)
        out.append((res["gate"], res["next_forward"]))
    return out


# small pieces and buckets so the tiny model has several of each
PIECES = {"piece_bytes": 512, "bucket_bytes": 2048, "max_in_flight": 2}


def equivalence_run(rank, world, steps=10, trace_dir=None, accumulation=False):
    """(a) stock vs EmbRace in every schedule setting, (b) a slow rank, (c) overlap traces,
    optionally gradient accumulation (stock vs EmbRace, 2 micro-steps)."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    results = {}
    for tied in (False, True):
        results[("stock", tied)] = train(rank, world, sharded=False, tied=tied, steps=steps)
    for ml in (True, False):
        for tl in (True, False):
            cfg = dict(PIECES, model_level=ml, tensor_level=tl)
            if trace_dir and ml and tl:  # the gate forced on: the trace test checks it holds pieces
                cfg.update(trace=os.path.join(trace_dir, "on"), exchange_gate=True)
            results[("embrace", False, ml, tl)] = train(rank, world, sharded=True, tied=False, steps=steps, embrace=cfg)
    results[("embrace", True, True, True)] = train(rank, world, sharded=True, tied=True, steps=steps, embrace=dict(PIECES))
    off = dict(PIECES, overlap=False)
    if trace_dir:
        off["trace"] = os.path.join(trace_dir, "off")
    results[("overlap_off", False)] = train(rank, world, sharded=True, tied=False, steps=steps, embrace=off)
    results[("slow", False)] = train(
        rank, world, sharded=True, tied=False, steps=steps, embrace=dict(PIECES), slow_rank=world - 1, slow_s=0.05
    )
    if accumulation:
        results[("stock_gas", True)] = train(rank, world, sharded=False, tied=True, steps=steps // 2, gas=2)
        results[("embrace_gas", True)] = train(rank, world, sharded=True, tied=True, steps=steps // 2, gas=2, embrace=dict(PIECES))
    return results



def _train_cfg(rank, world, *, sharded, steps, cfg, optimizer=None, tied=True, nan_at=None, nan_rank=0):
    """Train with a full DeepSpeed config (optimizer/scheduler from it or a client one)."""
    import deepspeed

    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(sharded, tied)
    opt = optimizer(model.parameters()) if optimizer is not None else None
    skip_shm_allreduce()  # no leaked /dev/shm buffer per rank
    init = initialize if sharded else deepspeed.initialize
    engine, *_ = init(model=model, optimizer=opt, model_parameters=list(model.parameters()), config=cfg)
    if nan_at is not None and rank == nan_rank:
        def poison(grad):
            return torch.full_like(grad, float("nan")) if engine.global_steps == nan_at else grad
        model.emb.weight.register_hook(poison)
    losses = []
    for step in range(steps):
        ids, tgt = _batch(step, rank)
        loss = engine(ids, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": model.full_state()}


def zero1_run(rank, world, steps=10):
    """Stock DeepSpeed ZeRO-1 vs EmbRace ZeRO-1: a client Adam with clipping, and
    AdamW plus a warm-up LR schedule from the config (hyper-parameters read live)."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    res = {}
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    base = _ds_config(stage=1)
    for sharded in (False, True):
        res[("adam", sharded)] = _train_cfg(rank, world, sharded=sharded, steps=steps, cfg=dict(base), optimizer=adam)
        cfg = dict(base, gradient_clipping=0.0,
                   optimizer={"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1, "torch_adam": True}},
                   scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2,
                                                               "warmup_num_steps": 5, "warmup_type": "linear"}})
        res[("adamw_sched", sharded)] = _train_cfg(rank, world, sharded=sharded, steps=steps, cfg=cfg)
        sgd = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=1e-3)  # noqa: E731
        res[("sgd_untied", sharded)] = _train_cfg(rank, world, sharded=sharded, steps=steps, cfg=dict(base, zero_allow_untested_optimizer=True),
                                                  optimizer=sgd, tied=False)
    return res


def nonfinite_run(rank, world, stage):
    """A NaN in one rank's shard gradient at step 2: every rank raises the same error."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    from embrace_fairseq.optim.grad_norm import NonFiniteGradientError

    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    try:
        _train_cfg(rank, world, sharded=True, steps=4, cfg=_ds_config(stage=stage), optimizer=adam,
                   nan_at=2, nan_rank=world - 1)
    except NonFiniteGradientError as exc:
        return {"error": str(exc), "isfpe": isinstance(exc, FloatingPointError)}
    return {"error": None}


def _train_relaxed(rank, world, *, sharded, tied, steps, embrace=None, next_ids=True, vocab=VOCAB, stage=0):
    """Like ``train`` without clipping; the relaxed hook is told the next batch's ids
    between forward and backward (or not, with ``next_ids=False``: every lookup waits)."""
    import deepspeed

    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(sharded, tied, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = _ds_config(clip=0.0, stage=stage)
    if sharded:
        engine, *_ = initialize(model=model, optimizer=opt, config=dict(cfg, embrace=embrace or {}))
    else:
        skip_shm_allreduce()  # no leaked /dev/shm buffer per rank
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for step in range(steps):
        ids, tgt = _batch(step, rank, vocab)
        loss = engine(ids, tgt)
        if sharded and next_ids:
            engine.embrace.next_batch(_batch(step + 1, rank, vocab)[0])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    hook = getattr(engine, "embrace", None)
    summary = hook.summary() if hook is not None else None
    if hook is not None:
        hook.close()
    return {"losses": losses, "state": model.full_state(), "summary": summary}


def relaxed_run(rank, world, steps=10, trace_dir=None, quick=False):
    """Stock vs EmbRace synchronous vs EmbRace relaxed (tied and untied, with and without
    next-batch ids, ZeRO-1), plus a traced run on a bigger table. ``quick``: untied
    relaxed at stage 0 and 1 only."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    res = {}
    relaxed = dict(PIECES, relaxed_embedding=True)
    for tied in ((False,) if quick else (False, True)):
        if quick:
            res[("stock", tied)] = _train_relaxed(rank, world, sharded=False, tied=tied, steps=steps)
            res[("relaxed", tied)] = _train_relaxed(rank, world, sharded=True, tied=tied, steps=steps, embrace=relaxed)
            break
        res[("stock", tied)] = _train_relaxed(rank, world, sharded=False, tied=tied, steps=steps)
        res[("sync", tied)] = _train_relaxed(rank, world, sharded=True, tied=tied, steps=steps, embrace=dict(PIECES))
        res[("relaxed", tied)] = _train_relaxed(rank, world, sharded=True, tied=tied, steps=steps, embrace=relaxed)
    if not quick:
        res[("relaxed_no_ids", False)] = _train_relaxed(rank, world, sharded=True, tied=False, steps=steps,
                                                        embrace=relaxed, next_ids=False)
    res[("relaxed_zero1", False)] = _train_relaxed(rank, world, sharded=True, tied=False, steps=steps, embrace=relaxed,
                                                   stage=1)
    if trace_dir:
        big = dict(relaxed, trace=os.path.join(trace_dir, "relaxed"))
        _train_relaxed(rank, world, sharded=True, tied=False, steps=4, embrace=big, vocab=20000)
    return res


def bf16_run(rank, world, steps=10):
    """bf16 with ZeRO-1: stock DeepSpeed vs EmbRace (client Adam, clipping)."""
    _ds_env(rank, world)
    torch.set_num_threads(1)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    cfg = dict(_ds_config(stage=1), bf16={"enabled": True})
    return {sharded: _train_cfg(rank, world, sharded=sharded, steps=steps, cfg=dict(cfg), optimizer=adam)
            for sharded in (False, True)}


def rel_diff(a, b) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def equivalence_and_gate_choices(rank, world, steps=10, trace_dir=None, accumulation=False):
    """:func:`equivalence_run` and :func:`gate_choices` in one spawned run (starting the
    ranks and importing DeepSpeed costs more than either)."""
    return {"equivalence": equivalence_run(rank, world, steps, trace_dir, accumulation),
            "gate_choices": gate_choices(rank, world)}
