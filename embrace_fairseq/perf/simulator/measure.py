"""A profile measured on this CPU (``measure`` command): the stock translation
Transformer's compute, unique ids of real batches and a check of the sparse-load model."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import numpy as np

from embrace_fairseq.perf.simulator.sparse_loads import sparse_loads


def fit_zipf_exponent(counts: Sequence[float], lo: int = 10, hi: int = 2000) -> float:
    """Least-squares slope of log count against log rank (ranks ``lo..hi``)."""
    c = np.sort(np.asarray([x for x in counts if x > 0], dtype=np.float64))[::-1]
    hi = min(hi, len(c))
    if hi - lo < 10:
        return 1.0
    r = np.arange(lo + 1, hi + 1, dtype=np.float64)
    slope = np.polyfit(np.log(r), np.log(c[lo:hi]), 1)[0]
    return float(-slope)


def _translation_setup(data_dir: str, max_tokens: int):
    """fairseq's stock ``transformer`` (2+2 layers, d=256, shared 8k vocabulary) on CPU."""
    import torch
    from fairseq import options, tasks

    argv = [data_dir, "--task", "translation", "--source-lang", "de", "--target-lang", "en", "--arch", "transformer",
            "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
            "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0.0", "--cpu", "--seed", "1",
            "--max-tokens", str(max_tokens)]
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    task = tasks.setup_task(args)
    task.load_dataset("train")
    torch.manual_seed(1)
    model = task.build_model(args)
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=max_tokens, seed=1).next_epoch_itr(shuffle=True)
    return task, model, task.build_criterion(args), itr


def _time_steps(model, criterion, batches: List[Any]) -> Dict[str, List[float]]:
    """Forward, backward and Adam step seconds of each batch but the first (warm-up)."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times: Dict[str, List[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i, sample in enumerate(batches):
        t0 = time.perf_counter()
        loss, _, _ = criterion(model, sample)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if i:  # the first step warms up
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
            times["optimizer"].append(t3 - t2)
    return times


def _ids(sample):
    import torch

    return torch.cat([sample["net_input"]["src_tokens"].reshape(-1), sample["net_input"]["prev_output_tokens"].reshape(-1)])


def _dense_layers(model, table) -> Dict[str, int]:
    layers: Dict[str, int] = {}
    for name, p in model.named_parameters():
        if p is table:
            continue
        parts = name.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ".".join(parts[:-1])
        layers[key] = layers.get(key, 0) + p.numel()
    return layers


def _sparse_load_check(itr, vocab: int, worlds: Sequence[int], zipf_s: float) -> Dict[str, dict]:
    """The sparse-load model against real batches: the busiest rank's rows under ShardPlan."""
    import torch

    from embrace_fairseq.core.shard_plan import ShardPlan

    check = {}
    for n in worlds:
        plan, busiest, uniq = ShardPlan(vocab, n, "contiguous"), [], []  # vs. the contiguous zipf model
        for rep in range(8):
            us = [torch.unique(_ids(next(itr))) for _ in range(n)]
            own = [[int(((u >= plan.boundaries[o]) & (u < plan.boundaries[o + 1])).sum()) for o in range(n)] for u in us]
            sends = [sum(own[r][o] for r in range(n) if r != o) for o in range(n)]
            recvs = [len(us[r]) - own[r][r] for r in range(n)]
            busiest.append(max(sends + recvs))
            uniq += [len(u) for u in us]
        model = sparse_loads(vocab, n, unique_per_rank=uniq, zipf_s=zipf_s)
        check[str(n)] = {"busiest_rows_measured": float(np.mean(busiest)), "busiest_rows_zipf": model.busiest_rows,
                         "off_owner_mean_zipf": model.off_owner_mean, "unique_mean": float(np.mean(uniq))}
    return check


def measure_translation_profile(data_dir: str, *, max_tokens: int = 512, steps: int = 6, worlds=(2, 4)) -> dict:
    """Time fairseq's stock ``transformer`` (2+2 layers, d=256, shared 8k vocabulary)
    forward, backward and Adam step on this CPU, one process, one thread; unique ids
    of real consecutive batches, dealt to ``N`` ranks. A profile in the bench format."""
    import torch

    torch.set_num_threads(1)
    task, model, criterion, itr = _translation_setup(data_dir, max_tokens)
    batches = [next(itr) for _ in range(steps + max(worlds))]
    times = _time_steps(model, criterion, batches[: steps + 1])
    table = model.encoder.embed_tokens.weight
    layers = _dense_layers(model, table)
    unique = {str(n): [int(torch.unique(_ids(b)).numel()) for b in batches[steps: steps + n]] for n in worlds}
    counts = task.source_dictionary.count[task.source_dictionary.nspecial:]
    zipf_s = fit_zipf_exponent(counts)
    return {
        "vocab": table.shape[0], "dim": table.shape[1], "dense_numel": sum(layers.values()),
        "dense_layers": [{"name": k, "numel": v} for k, v in layers.items()],
        "tokens_per_rank": float(np.mean([_ids(b).numel() for b in batches])),
        "compute_s": {k: float(np.median(v)) for k, v in times.items()},
        "unique_ids_per_rank": unique, "tied_output": "gather", "zipf_s": zipf_s,
        "sparse_load_check": _sparse_load_check(itr, table.shape[0], worlds, zipf_s),
        "measured_on": "this CPU, 1 process, 1 thread (stock fairseq transformer)",
    }
