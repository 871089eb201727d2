"""Measure the share of communication hidden behind computation, schedule on vs off.

    python -m embrace_fairseq.perf.hidden_share [--world 2] [--steps 12]

Trains a small model whose dense part is several MB (an embedding table, two wide
linear layers and an output layer) on CPU gloo ranks with the EmbRace hook, once with
the 2D schedule and overlap on and once with overlap off (all-reduce after backward,
as stock DeepSpeed does), and prints the trace summaries of rank 0 as JSON, with the clock
they were timed on (``clock``: ``host`` here; a CUDA job's traces are timed on its
device, and a trace over two clocks has no hidden share: ``core/trace.py``).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, BATCH, SEQ = 8000, 256, 2048, 16, 32


class WideLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from embrace_fairseq.core.sharded_embedding import ShardedEmbedding

        torch.manual_seed(0)
        self.emb = ShardedEmbedding(VOCAB, DIM, padding_idx=1)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.fc3 = nn.Linear(DIM, HIDDEN)
        self.fc4 = nn.Linear(HIDDEN, DIM)
        self.out = nn.Linear(DIM, 2000)

    def forward(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        h = h + self.fc4(torch.relu(self.fc3(h)))
        return F.cross_entropy(self.out(h).reshape(-1, 2000), tgt.reshape(-1))


def _rank(rank: int, world: int, steps: int, prefix: str) -> Dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    from embrace_fairseq.deepspeed_adapter import initialize

    out = {}
    for name, section in (("schedule_on", {}), ("schedule_off", {"overlap": False, "model_level": False,
                                                                    "tensor_level": False})):
        model = WideLM()
        dense_mb = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("emb")) / 2**20
        cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
               "embrace": dict(section, trace=f"{prefix}.{name}")}
        engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=cfg)
        g = torch.Generator().manual_seed(rank)
        for step in range(steps):
            if step == 2:
                engine.embrace.tracer.clear()  # warm-up steps out of the measurement
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            loss = engine(ids, torch.randint(0, 2000, (BATCH, SEQ), generator=g))
            engine.backward(loss)
            engine.step()
        s = engine.embrace.summary()
        engine.embrace.close()
        out[name] = {"dense_MB": round(dense_mb, 1), "clock": s["clock"], "hidden_share": round(s["hidden_share"], 3),
                     "comm_seconds": round(s["comm_seconds"], 3), "hidden_seconds": round(s["hidden_seconds"], 3),
                     "dense_started_in_backward": s["dense_started_in_backward"],
                     "dense_collectives": s["dense_collectives"]}
    return out


def main() -> None:
    from embrace_fairseq.tools.local_ranks import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trace-prefix", default="traces/hidden_share")
    a = ap.parse_args()
    results = run_ranks(_rank, a.world, a.steps, a.trace_prefix, timeout_s=900, pg_timeout_s=300)
    print(json.dumps({f"rank{r}": res for r, res in enumerate(results)}, indent=1))


if __name__ == "__main__":
    main()
