"""Per-rank bodies of the large-vocabulary workload tests: the benchmark's own builders,
the benchmark's own batches, several workloads in one spawned run (importing fairseq and
DeepSpeed dominates a run's cost)."""
import dataclasses
import os
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch


def strategies_agree(rank: int, world: int, names: Sequence[str], tokens: Dict[str, int], steps: int, data: str,
                     cache: str, strategies: Sequence[str] = ("fairseq_c10d", "embrace_schedule")) -> Dict[str, dict]:
    """Per workload: each strategy's losses over ``steps`` steps of the same batches, its
    token table's rows (the full table: stock's parameter, EmbRace's plan), this rank's
    shard rows and the model's parameter counts (:func:`W.dense_layers`' groups too).
    ``tokens[name]``: the workload's tokens per rank for this run."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (archs, CPU fixes)
    from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
    from embrace_fairseq.deepspeed_adapter.cpu_comm import skip_shm_allreduce
    from embrace_fairseq.perf.bench import builders
    from embrace_fairseq.perf.bench import workloads as W
    from embrace_fairseq.perf.bench.comm_count import CollectiveCounter

    skip_shm_allreduce()
    out: Dict[str, dict] = {}
    for name in names:
        w = W.workloads(quick=False)[name]
        if name in tokens:
            w = dataclasses.replace(w, tokens_per_rank=tokens[name])
        b = W.build_task_and_batches(w, world, Path(data), Path(cache))
        rec: Dict[str, dict] = {}
        for strat in strategies:
            t0 = time.perf_counter()
            s = builders.build(strat, w, b.task, Path(data), CollectiveCounter())
            t1 = time.perf_counter()
            table = W.token_table_module(s.module, w)
            losses: List[float] = [s.step(b.get(i, rank)) for i in range(steps)]
            s.settle()
            t2 = time.perf_counter()
            sharded = isinstance(table, ShardedEmbedding)
            layers = W.dense_layers(s.module, w)
            rec[strat] = {"losses": losses, "rows": int(table.num_embeddings),
                          "shard_rows": int(table.weight.shape[0]), "sharded": sharded,
                          "target_tokens": [b.target_tokens(i, rank) for i in range(steps)],
                          "parameters": sum(p.numel() for p in s.module.parameters()),
                          "table_numel": int(table.weight.numel()),
                          "dense_numel": sum(l["numel"] for l in layers),
                          "layer_groups": sum(".layers." in l["name"] for l in layers),
                          "build_s": t1 - t0, "steps_s": t2 - t1}
            if s.engine is not None:
                s.engine.embrace.close() if getattr(s.engine, "embrace", None) is not None else None
            del s
        out[name] = rec
    torch.distributed.barrier()
    return out
