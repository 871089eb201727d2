"""fairseq's own criteria over the vocab-parallel output layer.

``cross_entropy`` and ``label_smoothed_cross_entropy`` keep their names, flags and
logged values (``--label-smoothing``, ``--ignore-prefix-size``, ``--report-accuracy``,
``--sentence-avg``). Their ``forward`` is wrapped once, at import, to start the
all-gather of the step's target-token counts before the model runs (the loss then finds
them gathered). Their ``compute_loss`` / ``compute_accuracy`` are wrapped once, at
import: when the model's output is a :class:`~embrace_fairseq.core.sharded_output.VocabParallelLogits`
marker (training, vocab-parallel enabled), the loss is computed over the shards (or,
when the step's choice is the gather path, from the full logits by the stock code);
otherwise the stock code runs untouched.

``masked_lm`` (RoBERTa) computes its loss inside ``forward``; that ``forward`` is wrapped
too: when the model's LM head returns the marker, the loss of the masked positions
(the only ones the head projects) is computed over the shards, or from the full logits
when the step takes the gather path. A rank whose batch has no masked token gives the
loss no position and still takes part in every collective of the step.

``Trainer.__init__`` switches the path on for the model's output layers when the
criterion is one of these three; with another criterion ``--embrace-output
vocab-parallel`` stops at start-up and ``auto`` keeps the full-logits path.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, List

import torch
import torch.nn as nn
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq import modules
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.criterions.masked_lm import MaskedLmLoss
from fairseq.trainer import Trainer

from embrace_fairseq.core.sharded_output import VocabParallelLogits, VocabParallelOutput
from embrace_fairseq.core.vocab_parallel import GATHER, VOCAB_PARALLEL, label_smoothed_loss
from embrace_fairseq.core.errors import UserError

logger = logging.getLogger(__name__)

#: criteria (exact classes) whose loss is computed vocab-parallel
SUPPORTED_CRITERIA = (CrossEntropyCriterion, LabelSmoothedCrossEntropyCriterion, MaskedLmLoss)

_APPLIED = False


class VocabParallelUnsupported(UserError, ValueError):
    """``--embrace-output vocab-parallel`` with a loss that needs full logits."""


def output_layers(model: nn.Module) -> List[VocabParallelOutput]:
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, VocabParallelOutput) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def configure(model: nn.Module, criterion: Any) -> None:
    """Turn the vocab-parallel path on for the model's output layers if the criterion
    takes it; stop when the flag forces it and the criterion cannot."""
    layers = [m for m in output_layers(model) if m.output_mode != GATHER and m.output_table().is_sharded]
    if not layers:
        return
    supported = type(criterion) in SUPPORTED_CRITERIA
    if not supported:
        forced = [m for m in layers if m.output_mode == VOCAB_PARALLEL]
        if forced:
            raise VocabParallelUnsupported(
                f"--embrace-output vocab-parallel needs the cross_entropy, label_smoothed_cross_entropy or "
                f"masked_lm criterion; {type(criterion).__name__} reads full logits. Use --embrace-output auto "
                f"or gather."
            )
        logger.info("EmbRace output layer: %s needs full logits: gather path", type(criterion).__name__)
        for m in layers:
            m.enable_vocab_parallel(False)
        return
    for i, m in enumerate(layers):
        m.enable_vocab_parallel(True, name="EmbRace output layer" + (f" {i}" if len(layers) > 1 else ""))
    criterion._embrace_output_layers = layers  # for the per-step prefetch: no module walk per step
    criterion._embrace_model = weakref.ref(model)  # the prefetch is for this model's forward only


def _split(criterion: Any, model: Any, net_output: Any, sample: Any, prefix: int):
    """(hidden T x D, target T, mask of the flattened stock positions) of this rank's
    unmasked target positions."""
    marker: VocabParallelLogits = net_output[0]
    target = model.get_targets(sample, net_output)
    features = marker.features
    if prefix > 0:
        target = target[:, prefix:]
        features = features[:, prefix:]
    target = target.reshape(-1)
    mask = target.ne(criterion.padding_idx)
    hidden = features.reshape(-1, features.shape[-1])[mask]
    return hidden, target[mask], mask


def _runs_configured_model(criterion: Any, model: Any) -> bool:
    """Whether ``model`` is the model :func:`configure` saw, or a wrapper of it (fairseq's
    data-parallel wrappers and DeepSpeed's engine hold it in ``.module``)."""
    ref = getattr(criterion, "_embrace_model", None)
    target = ref() if ref is not None else None
    while model is not None and model is not target:
        model = getattr(model, "module", None)
    return target is not None and model is target


def _prefetch_token_counts(criterion: Any, model: Any, sample: Any) -> None:
    """Start the all-gather of the step's target-token counts before the forward, from
    the sample (the positions :func:`_split` will keep: padding and the ignored prefix
    removed), for every output layer :func:`configure` enabled whose forward will return
    the marker. Only when ``model`` is the configured one: the same criterion applied to
    another model (a stock copy, on one rank) must not start a collective."""
    layers = [m for m in getattr(criterion, "_embrace_output_layers", ()) if m.takes_marker]
    if not layers or not isinstance(sample, dict) or sample.get("target") is None:
        return
    if not _runs_configured_model(criterion, model):
        return
    target = sample["target"]
    prefix = getattr(criterion, "ignore_prefix_size", 0)
    if prefix > 0:
        target = target[:, prefix:]
    tokens = target.ne(criterion.padding_idx).sum()  # a tensor: no host synchronisation before the forward
    for m in layers:
        m.prefetch_token_counts(tokens)


def _criterion_forward(original):
    @functools.wraps(original)
    def forward(self, model, sample, reduce=True):
        _prefetch_token_counts(self, model, sample)
        return original(self, model, sample, reduce)

    forward._embrace_vocab_parallel = True  # type: ignore[attr-defined]
    return forward


def _unreduce(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    full = per_token.new_zeros(mask.shape[0])
    full[mask] = per_token
    return full


def _with_logits(net_output: Any) -> Any:
    return (net_output[0].logits(), *net_output[1:])


def _cross_entropy_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, net_output, sample, reduce=True):
        marker = net_output[0]
        if not isinstance(marker, VocabParallelLogits):
            return original(self, model, net_output, sample, reduce)
        hidden, target, mask = _split(self, model, net_output, sample, 0)
        res = marker.loss(hidden, target, smoothing=False, accuracy=False)
        if res is None:
            return original(self, model, _with_logits(net_output), sample, reduce)
        loss = res.nll.sum() if reduce else _unreduce(res.nll, mask)
        return loss, loss

    compute_loss._embrace_vocab_parallel = True  # type: ignore[attr-defined]
    return compute_loss


def _label_smoothed_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, model, net_output, sample, reduce=True):
        marker = net_output[0]
        if not isinstance(marker, VocabParallelLogits):
            return original(self, model, net_output, sample, reduce)
        hidden, target, mask = _split(self, model, net_output, sample, self.ignore_prefix_size)
        smoothing = self.eps != 0
        res = marker.loss(hidden, target, smoothing=smoothing, accuracy=self.report_accuracy)
        if res is None:
            return original(self, model, _with_logits(net_output), sample, reduce)
        marker.total = mask.sum()
        vocab = marker.layer.output_table().num_embeddings
        if reduce:
            nll = res.nll.sum()
            loss = label_smoothed_loss(nll, res.smooth.sum(), self.eps, vocab) if smoothing else nll
        else:
            nll = _unreduce(res.nll, mask).unsqueeze(1)
            loss = label_smoothed_loss(nll, _unreduce(res.smooth, mask).unsqueeze(1), self.eps, vocab) \
                if smoothing else nll
        return loss, nll

    compute_loss._embrace_vocab_parallel = True  # type: ignore[attr-defined]
    return compute_loss


def _label_smoothed_compute_accuracy(original):
    @functools.wraps(original)
    def compute_accuracy(self, model, net_output, sample):
        marker = net_output[0]
        if not isinstance(marker, VocabParallelLogits):
            return original(self, model, net_output, sample)
        if marker.choice is None:  # accuracy before any loss: decide now, no gradient
            hidden, target, mask = _split(self, model, net_output, sample, self.ignore_prefix_size)
            with torch.no_grad():
                marker.loss(hidden.detach(), target, smoothing=False, accuracy=True)
            marker.total = mask.sum()
        if marker.choice != VOCAB_PARALLEL:
            return original(self, model, _with_logits(net_output), sample)
        return marker.result.n_correct, marker.total

    compute_accuracy._embrace_vocab_parallel = True  # type: ignore[attr-defined]
    return compute_accuracy


def _masked_lm_forward(original):
    """``MaskedLmLoss.forward`` (same masking, loss and logging output) over the marker."""

    @functools.wraps(original)
    def forward(self, model, sample, reduce=True):
        layers = [m for m in getattr(self, "_embrace_output_layers", ()) if m.takes_marker]
        if not layers or self.tpu or not _runs_configured_model(self, model):
            return original(self, model, sample, reduce)
        masked_tokens = sample["target"].ne(self.padding_idx)
        sample_size = masked_tokens.int().sum()
        # as the stock loss: no masked token projects every position (their targets are
        # padding, so the loss below gets none of them)
        if masked_tokens.device == torch.device("cpu"):
            projected = masked_tokens if masked_tokens.any() else None
        else:
            projected = torch.where(masked_tokens.any(), masked_tokens, masked_tokens.new([True]))
        out = model(**sample["net_input"], masked_tokens=projected)[0]
        targets = model.get_targets(sample, [out])
        if projected is not None:
            targets = targets[projected]
        targets = targets.reshape(-1)
        loss = None
        if isinstance(out, VocabParallelLogits):
            keep = targets.ne(self.padding_idx)
            hidden = out.features.reshape(-1, out.features.shape[-1])[keep]
            res = out.loss(hidden, targets[keep], smoothing=False, accuracy=False)  # collective, also for 0 tokens
            if res is not None:
                loss = res.nll.sum()
            else:
                out = out.logits()
        if loss is None:
            loss = modules.cross_entropy(out.view(-1, out.size(-1)), targets, reduction="sum",
                                         ignore_index=self.padding_idx)
        logging_output = {"loss": loss.data, "ntokens": sample["ntokens"], "nsentences": sample["nsentences"],
                          "sample_size": sample_size}
        return loss, sample_size, logging_output

    forward._embrace_vocab_parallel = True  # type: ignore[attr-defined]
    return forward


def _trainer_init(original):
    @functools.wraps(original)
    def __init__(self: Trainer, cfg, task, model, criterion, *args, **kwargs):
        configure(model, criterion)
        return original(self, cfg, task, model, criterion, *args, **kwargs)

    return __init__


def apply() -> None:
    """Wrap the three criteria and the trainer once (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    MaskedLmLoss.forward = _masked_lm_forward(MaskedLmLoss.forward)  # inside the count prefetch below
    for criterion in SUPPORTED_CRITERIA:
        criterion.forward = _criterion_forward(criterion.forward)
    CrossEntropyCriterion.compute_loss = _cross_entropy_compute_loss(CrossEntropyCriterion.compute_loss)
    LabelSmoothedCrossEntropyCriterion.compute_loss = _label_smoothed_compute_loss(
        LabelSmoothedCrossEntropyCriterion.compute_loss)
    LabelSmoothedCrossEntropyCriterion.compute_accuracy = _label_smoothed_compute_accuracy(
        LabelSmoothedCrossEntropyCriterion.compute_accuracy)
    Trainer.__init__ = _trainer_init(Trainer.__init__)
    _APPLIED = True

