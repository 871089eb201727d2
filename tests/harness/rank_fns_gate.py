"""Per-rank body of the exchange-gate test: the tied translation model (``embrace_transformer``
with ``--share-all-embeddings``, tiny sizes) under the DeepSpeed hook, in real gloo ranks.

One table serves the encoder lookup, the decoder lookup and the tied output projection.
Two variants: ``joint`` (the architecture as it is: one exchange for both lookups) and
``separate`` (the same model looking the source and target tokens up one after the
other, as ``TransformerModel.forward`` does: two exchanges, the decoder's first in
backward, before the whole encoder's backward). Each rank trains a few steps per
variant, records after each step whether the exchange gate is open and how often it was
entered and left, and returns the trace events with the names of the parameters in
each dense bucket.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

VOCAB, STEPS, BATCH, SRC_LEN, TGT_LEN = 60, 4, 8, 24, 8
#: exchanges per step in each variant
EXCHANGES = {"joint": 1, "separate": 2}


def _tied_translation_model(variant: str, **arch: Any):
    from fairseq.data import Dictionary
    from fairseq.models.transformer import base_architecture

    from embrace_fairseq.fairseq_adapter.models import EmbraceTransformerModel

    d = Dictionary()
    for i in range(VOCAB - len(d)):
        d.add_symbol(f"w{i}")
    args = argparse.Namespace(
        share_all_embeddings=True, encoder_layers=3, decoder_layers=1, encoder_embed_dim=32, decoder_embed_dim=32,
        encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
        dropout=0.0, attention_dropout=0.0, max_source_positions=64, max_target_positions=64, **arch)
    base_architecture(args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    torch.manual_seed(7)
    model = EmbraceTransformerModel.build_model(args, task)
    if variant == "separate":
        from fairseq.models.transformer import TransformerModel

        model.forward = lambda *a, **k: TransformerModel.forward(model, *a, **k)  # no joint lookup
    return model, d


def gate_run(rank: int, world: int, trace_prefix: str) -> Dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    return {variant: _train(variant, f"{trace_prefix}.{variant}") for variant in EXCHANGES}


def _train(variant: str, trace_prefix: str) -> Dict[str, Any]:
    from embrace_fairseq.deepspeed_adapter import initialize
    from embrace_fairseq.deepspeed_adapter.engine_setup import dense_parameters

    model, d = _tied_translation_model(variant)
    names = {id(p): n for n, p in model.named_parameters()}
    # one bucket per few tensors and credits for every piece: the static issue list is the
    # readiness order, so only the gate decides when a ready piece goes out
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": 0.5,
           "embrace": {"bucket_bytes": 4096, "piece_bytes": 1 << 20, "max_in_flight": 64, "trace": trace_prefix,
                      "exchange_gate": True}}
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=cfg)
    hook = engine.embrace
    gate = hook.gate
    g = torch.Generator().manual_seed(100 + int(os.environ["RANK"]))
    losses: List[float] = []
    after_step: List[Dict[str, Any]] = []
    for _ in range(STEPS):
        src = torch.randint(d.nspecial, VOCAB, (BATCH, SRC_LEN), generator=g)
        prev = torch.randint(d.nspecial, VOCAB, (BATCH, TGT_LEN), generator=g)
        tgt = torch.randint(d.nspecial, VOCAB, (BATCH, TGT_LEN), generator=g)
        lengths = torch.full((BATCH,), SRC_LEN, dtype=torch.long)
        logits, _ = engine(src, lengths, prev)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        after_step.append({"open": not gate.busy, "entered": gate.entered, "left": gate.left})
    params = dense_parameters(model)
    buckets = {b.index: [names[id(params[t])] for t in b.tensors] for b in hook.schedule.buckets}
    events = [e for e in hook.tracer.events() if e["name"] in ("backward", "dense_grad", "gradients_ready", "grad_rows", "agreed")]
    hook.close()
    return {"losses": losses, "after_step": after_step, "buckets": buckets, "events": events}
