"""Per-rank bodies of the cross-iteration overlap tests (DeepSpeed hook, real gloo ranks).

``tiny``: the small LM of the hook's equivalence tests, stock DeepSpeed against EmbRace
with ``"next_forward": true`` (no clipping, so it applies), and with clipping on (where
it must fall back). ``transformer``: fairseq's tied translation Transformer
(``embrace_transformer``, layers in module lists) shaped as BART is (pre-norm with final
layer norms, learned positions, a layer norm on the embeddings) with and without it: same
losses and weights, and the dense updates done inside the next forward, layer by layer,
the layer norms and positions outside the layers at their own modules.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

import rank_fns_deepspeed as D
import rank_fns_gate as G

STEPS = 6
#: what BART adds to the Transformer outside its layers: each a module of its own
BART_LIKE = dict(encoder_normalize_before=True, decoder_normalize_before=True, layernorm_embedding=True,
                 encoder_learned_pos=True, decoder_learned_pos=True)
PIECES = dict(D.PIECES)


def tiny(rank: int, world: int) -> Dict[str, Any]:
    D._ds_env(rank, world)
    torch.set_num_threads(1)
    out = {}
    for tied in (False, True):
        out[("stock", tied)] = D.train(rank, world, sharded=False, tied=tied, steps=STEPS, clip=0.0)
        out[("next_forward", tied)] = D.train(rank, world, sharded=True, tied=tied, steps=STEPS, clip=0.0,
                                              embrace=dict(PIECES, next_forward=True))
    out[("clipped", True)] = D.train(rank, world, sharded=True, tied=True, steps=2, clip=0.05,
                                     embrace=dict(PIECES, next_forward=True))
    return out


def transformer(rank: int, world: int) -> Dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    return {nf: _train_transformer(nf) for nf in (False, True)}


def _train_transformer(next_forward: bool) -> Dict[str, Any]:
    from embrace_fairseq.deepspeed_adapter import initialize

    model, d = G._tied_translation_model("joint", **BART_LIKE)
    cfg = {"train_micro_batch_size_per_gpu": G.BATCH, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "embrace": {"bucket_bytes": 8192, "piece_bytes": 4096, "next_forward": next_forward, "trace": None}}
    engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.basic_optimizer, lambda k: 1.0 / (1 + k))  # lr moves every step
    hook = engine.embrace
    hook.tracer.enabled = True
    g = torch.Generator().manual_seed(100 + int(os.environ["RANK"]))
    losses: List[float] = []
    in_forward: List[int] = []
    for _ in range(STEPS):
        src = torch.randint(d.nspecial, G.VOCAB, (G.BATCH, G.SRC_LEN), generator=g)
        prev = torch.randint(d.nspecial, G.VOCAB, (G.BATCH, G.TGT_LEN), generator=g)
        tgt = torch.randint(d.nspecial, G.VOCAB, (G.BATCH, G.TGT_LEN), generator=g)
        lengths = torch.full((G.BATCH,), G.SRC_LEN, dtype=torch.long)
        logits, _ = engine(src, lengths, prev)
        if hook.next_forward is not None:
            in_forward.append(hook.next_forward.updated_in_forward)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        engine.backward(loss)
        engine.step()
        sched.step()
        losses.append(float(loss.detach()))
    hook.flush()
    state = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    events = [e for e in hook.tracer.events() if e["name"] in ("forward", "next_forward_update")]
    layers = {}
    if hook.next_forward is not None:
        names = {m: n for n, m in model.named_modules()}
        layers = {names[m]: bs for m, bs in hook.next_forward.buckets_by_module.items()}
    hook.close()
    return {"losses": losses, "state": state, "in_forward": in_forward, "events": events, "layers": layers,
            "buckets": len(hook.schedule.buckets), "active": hook.next_forward is not None}


def tiny_and_transformer(rank: int, world: int) -> Dict[str, Any]:
    """:func:`tiny` and :func:`transformer` in one spawned run (the start-up of the ranks,
    importing DeepSpeed and fairseq, costs more than either)."""
    return {"tiny": tiny(rank, world), "transformer": transformer(rank, world)}
