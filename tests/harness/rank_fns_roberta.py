"""Per-rank bodies of the RoBERTa tests (spawned in real gloo ranks): one masked-LM step
of ``embrace_roberta`` against stock ``roberta``, and stock checkpoints restored into
the EmbRace architectures through fairseq's own trainer and saved again."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

ROBERTA_MODEL = ["--encoder-layers", "1", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
                 "--encoder-attention-heads", "2"]
ROBERTA_TINY = [*ROBERTA_MODEL, "--tokens-per-sample", "32"]  # masked_lm


def setup(data: str, task: str, arch: str, flags: Sequence[str], extra: Sequence[str] = ()):
    """(cfg, task) of a fairseq-train command line (``--user-dir user_dir``, CPU)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_corpus import USER_DIR

    args = options.parse_args_and_arch(options.get_training_parser(), [
        data, "--user-dir", str(USER_DIR), "--task", task, "--arch", arch, *flags, "--cpu", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    return cfg, tasks.setup_task(cfg.task)


def masked_sample(vocab: int, pad: int, batch: int, length: int, masked: int, seed: int) -> Dict[str, Any]:
    """A masked-LM batch: ``masked`` positions per sentence carry a target (0: none)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (batch, length), generator=g)
    src[:, 0] = 0  # <s>
    target = torch.full_like(src, pad)
    for b in range(batch):
        pos = torch.randperm(length - 1, generator=g)[:masked] + 1
        target[b, pos] = src[b, pos]
        src[b, pos] = vocab - 1  # <mask>, the last symbol masked_lm adds
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), length)}, "target": target,
            "ntokens": int(target.ne(pad).sum()), "nsentences": batch}


def _mean_over_ranks(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.detach().clone()
    if world > 1:
        dist.all_reduce(t)
    return t / world


def masked_lm_step(rank: int, world: int, data: str, mode: str, empty_rank: int = -1,
                   arch: str = "roberta", layout: str = "strided", defer: bool = False) -> Dict[str, Any]:
    """One forward/backward of ``masked_lm`` on each rank's own batch (``empty_rank``'s has
    no masked token): the EmbRace model's loss, and its gradients averaged over ranks as
    data parallelism leaves them, against the stock model's, same initial weights. The
    largest relative differences and the output layer's choice. ``defer``: the table's
    gradient from the output layer is computed at ``finish_pending`` (``owed``: the
    gradients owed after the backward, and whether the bias had its gradient then)."""
    from embrace_fairseq.core.sharded_embedding import sharded_embeddings
    from embrace_fairseq.fairseq_adapter.vocab_parallel_criteria import configure

    flags = [*ROBERTA_TINY, "--criterion", "masked_lm", "--dropout", "0", "--attention-dropout", "0"]
    cfg, task = setup(data, "masked_lm", arch, flags)
    torch.manual_seed(5)
    stock = task.build_model(cfg.model)
    cfg_o, _ = setup(data, "masked_lm", "embrace_" + arch, flags,
                     ["--embrace-output", mode, "--embrace-shard-layout", layout])
    torch.manual_seed(5)
    ours = task.build_model(cfg_o.model)
    criterion = task.build_criterion(cfg.criterion)
    configure(ours, criterion)
    for emb in sharded_embeddings(ours):
        emb.set_defer_output_grad(defer)
    pad, vocab = task.source_dictionary.pad(), len(task.source_dictionary)
    sample = masked_sample(vocab, pad, 3, 12, 0 if rank == empty_rank else 2 + rank, seed=rank)
    out = {}
    for name, model in (("stock", stock), ("ours", ours)):
        model.train()
        loss, sample_size, log = criterion(model, sample)
        loss.backward()
        out[name] = (float(loss), int(sample_size))
    table = sharded_embeddings(ours)[0]
    owed = (len(table.deferred_grads), ours.encoder.lm_head.bias.grad is not None)
    table.finish_pending()
    grads_s = dict(stock.named_parameters())
    worst, worst_name = 0.0, None
    for name, p in ours.named_parameters():
        ref = _mean_over_ranks(grads_s[name].grad, world)
        if p is table.weight:
            ref = table.shard_of(ref)
            got = p.grad
        else:
            got = _mean_over_ranks(p.grad, world)
        # k_proj.bias has no gradient but rounding (softmax ignores a per-query constant)
        rel = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-4))
        if rel > worst:
            worst, worst_name = rel, name
    head = ours.encoder.lm_head.output
    return {"loss": out, "grad_rel": worst, "worst": worst_name, "choice": head.chooser.last if head.chooser else "off",
            "shard_rows": int(table.weight.shape[0]), "owed": owed}


# ----------------------------------------------------------------------------- checkpoints


def restore_and_save(rank: int, world: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """For each case: fairseq-train's start-up with ``--restore-file`` of a stock checkpoint
    (``--reset-*``) or ``--finetune-from-model`` on the EmbRace architecture, through
    fairseq's own ``checkpoint_utils.load_checkpoint`` and ``Trainer``, then its
    ``save_checkpoint`` with no update in between. A case with ``expect_error`` returns
    the error every rank raised instead."""
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    results = []
    for case in cases:
        cfg, task = setup(case["data"], case["task"], case["arch"], case["flags"], [
            "--optimizer", "adam", "--lr", "0.001", "--save-dir", case["save_dir"], "--no-epoch-checkpoints",
            "--max-tokens", "64", "--num-workers", "0", *case["load"]])
        cfg.distributed_training.distributed_world_size = world
        cfg.distributed_training.distributed_rank = rank
        torch.manual_seed(1)
        model = task.build_model(cfg.model)
        criterion = task.build_criterion(cfg.criterion)
        trainer = Trainer(cfg, task, model, criterion)
        try:
            extra_state, epoch_itr = checkpoint_utils.load_checkpoint(cfg.checkpoint, trainer)
        except Exception as exc:  # fairseq wraps the load's error: report the whole chain
            chain, e = [], exc
            while e is not None:
                chain.append(f"{type(e).__name__}: {e}")
                e = e.__cause__ or e.__context__
            results.append({"error": "\n".join(chain)})
            continue
        assert case.get("expect_error") is None, "the load should have failed"
        shard = {type(m).__name__: int(m.weight.shape[0]) for m in model.modules() if hasattr(m, "plan")}
        epoch_itr.next_epoch_itr(shuffle=False)  # as fairseq-train before its first update
        checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
        results.append({"shards": shard, "num_updates": trainer.get_num_updates()})
    return results


def masked_lm_steps(rank: int, world: int, data: str, configs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """:func:`masked_lm_step` for each configuration, in one process group."""
    return [masked_lm_step(rank, world, data, **c) for c in configs]
