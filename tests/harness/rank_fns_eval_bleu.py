"""Per-rank body of the ``--eval-bleu`` validation tests (spawned in real gloo ranks).

Each rank builds the same stock ``transformer`` (same seed), trains it a few steps alone
on the same batches (deterministic on CPU, so every rank holds the same weights without
any communication), then builds the EmbRace architecture with those weights. Both run
fairseq's validation with ``--eval-bleu`` as ``fairseq_cli.train.validate`` drives it:
the rank's shard of the valid batches, a dummy batch where a rank has fewer, the model
in eval mode, ``task.valid_step`` under ``torch.no_grad()`` (loss, then generation and
BLEU statistics). Every ``torch.distributed`` call is counted per batch, and the decoder
steps (output-layer calls) are counted per batch.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

# Every torch.distributed entry point a collective can go through.
_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "recv", "isend", "irecv",
)

TINY = [
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--dropout", "0", "--attention-dropout", "0",
]


class CollectiveCounter:
    """Counts calls of every torch.distributed collective while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: Dict[str, Any] = {}

    def __enter__(self) -> "CollectiveCounter":
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(*a, _fn=fn, **k):
                self.count += 1
                return _fn(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _setup(data: str, arch: str, flags: List[str]):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_corpus import USER_DIR

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        data, "--user-dir", str(USER_DIR), "--task", "translation", "--arch", arch, *TINY, *flags,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 2, "max_len_a": 1.2, "max_len_b": 3}',
        "--eval-bleu-detok", "space", "--max-tokens", "60", "--cpu", "--seed", "1",
    ])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    task.load_dataset("valid")
    return cfg, task


def _batches(task, model, split: str, shards: int, shard: int, max_tokens: int):
    from fairseq import utils

    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        seed=1, num_shards=shards, shard_id=shard, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    return list(itr)


def _train_stock(cfg, task, steps: int):
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = [b for b in _batches(task, model, "train", 1, 0, 200) if b]
    model.train()
    for step in range(steps):
        sample = batches[step % len(batches)]
        loss, _, _ = criterion(model, sample)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _validate(task, model, criterion, rank: int, world: int) -> Dict[str, Any]:
    """fairseq's validation of one subset on this rank (fairseq_cli.train.validate with
    Trainer.valid_step): dummy batches where the rank's shard is shorter."""
    batches = _batches(task, model, "valid", world, rank, 60)
    dummy = next(b for b in batches if b)
    hyps: List[List[int]] = []
    steps = {"n": 0}
    recording = {"on": True}
    inference_step = task.inference_step

    def recorded_inference_step(generator, models, sample, **kw):
        out = inference_step(generator, models, sample, **kw)
        if recording["on"]:
            hyps.extend(o[0]["tokens"].tolist() for o in out)
        return out

    task.inference_step = recorded_inference_step
    # the generator calls decoder.forward() directly; the output layer is called as a module
    hook = model.decoder.output_projection.register_forward_pre_hook(lambda *a: steps.__setitem__("n", steps["n"] + 1))
    logs, collectives, decoder_calls = [], [], []
    try:
        for sample in batches:
            real = bool(sample)
            recording["on"] = real
            model.eval()  # what Trainer.valid_step does for every batch
            criterion.eval()
            before = steps["n"]
            with CollectiveCounter() as counter, torch.no_grad():
                _, _, log = task.valid_step(sample if real else dummy, model, criterion)
            collectives.append(counter.count)
            decoder_calls.append(steps["n"] - before)
            if real:
                logs.append({k: float(v) for k, v in log.items()})
    finally:
        hook.remove()
        task.inference_step = inference_step
    keys = ["loss", "nll_loss", "ntokens", "_bleu_sys_len", "_bleu_ref_len"] + [
        f"_bleu_{kind}_{i}" for kind in ("counts", "totals") for i in range(4)]
    totals = {k: sum(log.get(k, 0.0) for log in logs) for k in keys}
    return {"hyps": hyps, "totals": totals, "collectives": collectives, "decoder_calls": decoder_calls,
            "batches": len(batches)}


def eval_bleu_validation(rank: int, world: int, data: str, flags: List[str], train_steps: int = 60,
                         ours_flags: List[str] = ()) -> Dict[str, Any]:
    """Validation with ``--eval-bleu`` of the stock model and of the EmbRace model holding
    the same weights, on this rank's shard of the valid set (``ours_flags``: EmbRace flags)."""
    cfg_stock, task_stock = _setup(data, "transformer", flags)
    stock = _train_stock(cfg_stock, task_stock, train_steps)
    out_stock = _validate(task_stock, stock, task_stock.build_criterion(cfg_stock.criterion), rank, world)

    cfg_ours, task_ours = _setup(data, "embrace_transformer", flags + list(ours_flags))
    ours = task_ours.build_model(cfg_ours.model)
    ours.load_state_dict(stock.state_dict())  # full tables: each rank keeps its rows
    tables = [m for m in ours.modules() if type(m).__name__ in ("ShardedEmbedding", "ShardedOutputProjection")]
    out_ours = _validate(task_ours, ours, task_ours.build_criterion(cfg_ours.criterion), rank, world)

    # back to training drops the replicas
    ours.train()
    dropped = all(t._replica is None for t in tables)
    # a shard changed in evaluation (a load, say) is gathered afresh: never a stale replica
    ours.eval()
    with torch.no_grad():
        for t in tables:
            t.eval_replica()
            t.weight.add_(0.5)
        fresh = [float((t.eval_replica() - t.full_weight()).abs().max()) for t in tables]
    return {"stock": out_stock, "ours": out_ours, "tables": len(tables), "dropped_on_train": dropped,
            "replica_vs_fresh_gather": fresh}
