"""Output layers over a sharded table that can hand their loss to the vocab-parallel path.

An output layer (tied: :class:`~.tied_projection.TiedShardedProjection`; untied:
:class:`ShardedOutputProjection`) returns full logits (``features @ W^T`` against the
gathered table) unless the vocab-parallel path is switched on for it
(:meth:`VocabParallelOutput.enable_vocab_parallel`, done by an adapter once it knows
the loss can take it) *and* it runs in training with gradients. Then it returns a
:class:`VocabParallelLogits` marker holding the features: the loss asks the marker,
which picks the path for the step (:class:`~.vocab_parallel.OutputChooser`, from
every rank's token count) and returns either the full logits or the per-token losses
computed vocab-parallel. Evaluation, generation and anything reading log-probabilities
keep the logits path.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq.core import collectives
from embrace_fairseq.core.ledger import ledgers_for
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT
from embrace_fairseq.core.sharded_embedding import ShardedEmbedding
from embrace_fairseq.core.vocab_parallel import (
    AUTO,
    GATHER,
    OUTPUT_MODES,
    VOCAB_PARALLEL,
    OutputChooser,
    OutputCost,
    PrefetchedCounts,
    VocabParallelLoss,
    VocabShardSpec,
    _gather_counts,
    output_bytes,
    prefetch_counts,
    vocab_parallel_loss,
)

logger = logging.getLogger(__name__)


class VocabParallelOutput:
    """Mixin for an output layer reading a :class:`ShardedEmbedding`'s rows.

    ``output_mode``: ``auto``, ``vocab-parallel`` or ``gather``, as configured;
    ``chooser`` is set (and the marker returned in training) only once
    :meth:`enable_vocab_parallel` is called.
    """

    output_mode: str = GATHER
    chooser: Optional[OutputChooser] = None
    _counts_ahead: Optional[PrefetchedCounts] = None  # :meth:`prefetch_token_counts`
    _counts_known: Optional[List[int]] = None  # those counts, waited for at the table's first lookup
    _cost_args: Optional[Dict[str, Any]] = None  # the last step's loss: smoothing, accuracy, element size
    _told_deferred = False  # the log has said once that this layer's table gradient is deferred

    def output_table(self) -> ShardedEmbedding:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_output_mode(self, mode: str) -> None:
        if mode not in OUTPUT_MODES:
            raise ValueError(f"output mode must be one of {OUTPUT_MODES}, got {mode!r}")
        self.output_mode = mode

    def enable_vocab_parallel(self, enabled: bool = True, name: str = "output layer") -> None:
        """Let training steps take the vocab-parallel path (per step when ``auto``)."""
        table = self.output_table()
        on = enabled and self.output_mode != GATHER and table.is_sharded
        self.chooser = OutputChooser(self.output_mode, name) if on else None
        # the table's first lookup of a step asks whether to start the full table's gather
        table.full_table_read_ahead = self.reads_full_table_ahead if on else None

    @property
    def takes_marker(self) -> bool:
        """Whether a forward now returns the :class:`VocabParallelLogits` marker."""
        return self.chooser is not None and self.training and torch.is_grad_enabled()

    def prefetch_token_counts(self, tokens: Union[int, torch.Tensor]) -> None:
        """Start this step's all-gather of every rank's target-token count now
        (asynchronous), before the forward: the loss then waits for it, usually long
        done, instead of gathering the counts itself. ``tokens`` (an int or a
        one-element tensor) must be the number of positions the loss will get.
        Collective; call it on every rank alike, only when :attr:`takes_marker`."""
        table = self.output_table()
        self._counts_known = None
        self._counts_ahead = prefetch_counts(tokens, table.group, tuple(ledgers_for(table.ledger)))

    def path_cost(self, counts: List[int], *, smoothing: bool, accuracy: bool, elem_bytes: int) -> OutputCost:
        """Bytes of each path for a step with every rank's token ``counts``."""
        table = self.output_table()
        return output_bytes(table.num_embeddings, table.embedding_dim, counts, elem_bytes=elem_bytes,
                            smoothing=smoothing, accuracy=accuracy, max_shard_rows=table.plan.max_shard_size)

    def reads_full_table_ahead(self) -> Optional[bool]:
        """Whether this step's loss will take the gather path, asked by the table's first
        lookup (:attr:`ShardedEmbedding.full_table_read_ahead`) before it starts the full
        table's all-gather: a step that goes vocab-parallel sends no ``V x D`` table and
        holds none beside its ``M x V/N`` logits. In ``auto`` this waits for the step's
        token counts (:meth:`prefetch_token_counts`, issued before the forward) and
        prices them with the last step's loss settings: every rank has the same counts,
        so every rank gives the same answer (the prefetch is a collective). None where it
        cannot tell (no counts prefetched, no step decided yet): the table then does what
        the last step did."""
        if self.chooser is None or not self.takes_marker:
            return None
        if self.chooser.mode != AUTO:
            return self.chooser.mode == GATHER
        if self._cost_args is None:
            return None
        if self._counts_known is None:
            if self._counts_ahead is None:
                return None
            # a host wait on the tiny count gather: a step on either path waits for it anyway
            self._counts_known, self._counts_ahead = self._counts_ahead.wait(), None
        return self.path_cost(self._counts_known, **self._cost_args).choose(AUTO) == GATHER

    def full_logits(self, features: torch.Tensor) -> torch.Tensor:
        weight = self.output_table().gathered_weight()
        if features.dim() > 2 and not weight.requires_grad:
            # torch folds (B, T, D) @ W^T into one matrix product only when W requires
            # grad; for a weight that does not (the evaluation replica) and transposed
            # features (the decoder's) it runs a batched product over B copies of W,
            # several times slower. Fold here, as it does for a parameter.
            flat = F.linear(features.reshape(-1, features.shape[-1]), weight)
            return flat.view(*features.shape[:-1], weight.shape[0])
        return F.linear(features, weight)

    def shard_operands(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(hidden, weight, extra)``: ``hidden @ [weight | extra]^T`` is this rank's logits
        for the vocab-parallel loss; ``weight`` the table's own shard, ``extra`` None or
        more columns of it for a layer with more than ``features @ W^T`` (a bias's rows,
        against columns appended to ``hidden``)."""
        return hidden, self.output_table().weight, None

    def extra_grad_scale(self) -> Optional[float]:
        """The factor on the gradient of :meth:`shard_operands`' ``extra`` columns, applied in
        float32 before their one rounding; None: the table's ``grad_scale``."""
        return None

    def project(self, features: torch.Tensor):
        if self.takes_marker:
            return VocabParallelLogits(features, self)
        return self.full_logits(features)


class VocabParallelLogits:
    """What a vocab-parallel output layer returns in training instead of logits.

    A loss that knows it calls :meth:`loss` (or :meth:`logits` for the full-table path);
    anything else that treats it as a tensor fails with a message naming the cause.
    """

    def __init__(self, features: torch.Tensor, layer: VocabParallelOutput) -> None:
        self.features = features
        self.layer = layer
        self._logits: Optional[torch.Tensor] = None
        self.choice: Optional[str] = None
        self.cost: Optional[OutputCost] = None
        self.result: Optional[VocabParallelLoss] = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{getattr(func, '__name__', func)}() was given the vocab-parallel output of an EmbRace model "
            "instead of logits: this loss or tool does not support the vocab-parallel output layer. "
            "Use --embrace-output gather (DeepSpeed: \"output\": \"gather\" in the \"embrace\" section)."
        )

    def __repr__(self) -> str:
        return f"VocabParallelLogits(features={tuple(self.features.shape)}, choice={self.choice})"

    def logits(self) -> torch.Tensor:
        """Full logits against the gathered table (computed once)."""
        if self._logits is None:
            self._logits = self.layer.full_logits(self.features)
        return self._logits

    def decide(self, hidden_tokens: int, *, smoothing: bool, accuracy: bool) -> Tuple[str, list]:
        """The path for this step (collective: all-gathers the token counts, unless
        :meth:`VocabParallelOutput.prefetch_token_counts` started that already)."""
        table = self.layer.output_table()
        prefetched, self.layer._counts_ahead = self.layer._counts_ahead, None
        known, self.layer._counts_known = self.layer._counts_known, None
        if known is None and prefetched is None:
            counts = _gather_counts(hidden_tokens, table.group, tuple(ledgers_for(table.ledger)))
        else:
            counts = known if known is not None else prefetched.wait()
            announced = counts[collectives.rank(table.group)]
            if announced != hidden_tokens:
                raise RuntimeError(
                    f"{self.layer.chooser.name}: {announced} target tokens were announced to the other "
                    f"ranks before the forward, but the loss got {hidden_tokens}")
        self.layer._cost_args = dict(smoothing=smoothing, accuracy=accuracy, elem_bytes=self.features.element_size())
        self.cost = self.layer.path_cost(counts, **self.layer._cost_args)
        self.choice = self.layer.chooser.choose(self.cost)
        return self.choice, counts

    def loss(self, hidden: torch.Tensor, target: torch.Tensor, *, smoothing: bool, accuracy: bool) -> Optional[VocabParallelLoss]:
        """Per-token losses of ``hidden`` (``T x D``, this rank's unmasked positions) by the
        vocab-parallel path, or None when the step takes the full-logits path (then
        call :meth:`logits`). Collective."""
        choice, counts = self.decide(hidden.shape[0], smoothing=smoothing, accuracy=accuracy)
        table = self.layer.output_table()
        if choice != VOCAB_PARALLEL:
            return None
        table._read_full_table = False  # no table prefetch for the next steps' lookups
        if table.relaxed is not None:
            table.relaxed.before_full_read(table)
        table.deferred_grads.flush()  # a previous backward's, not finished (accumulation)
        if table.defer_output_grad and not self.layer._told_deferred:
            self.layer._told_deferred = True
            logger.info("EmbRace output layer: the table's gradient is computed after the backward, beside the "
                        "dense all-reduce (deferred)")
        spec = VocabShardSpec(
            rows=table.vocab_ids(), vocab_size=table.num_embeddings, group=table.group,
            grad_scale=table.grad_scale, ledgers=tuple(ledgers_for(table.ledger)),
            deferred=table.deferred_grads if table.defer_output_grad else None,
            extra_scale=self.layer.extra_grad_scale(),
        )
        hidden, weight, extra = self.layer.shard_operands(hidden)
        self.result = vocab_parallel_loss(
            hidden, weight, target, spec, smoothing=smoothing, accuracy=accuracy, counts=counts, extra=extra
        )
        return self.result


class ShardedOutputProjection(VocabParallelOutput, ShardedEmbedding):
    """Untied output projection (``nn.Linear(D, V, bias=False)``) with its rows sharded
    over the data-parallel ranks like the input tables.

    Initialised as fairseq initialises its untied projection, drawing the random stream
    identically; its state dict holds the full ``V x D`` weight under ``weight`` (after
    :func:`~.sharded_embedding.consolidate`), the key and shape of the stock layer.
    """

    def __init__(self, in_features: int, out_features: int, process_group=None, *, mode: str = "auto",
                 layout: str = DEFAULT_LAYOUT) -> None:
        with torch.random.fork_rng(devices=[]):  # the table's own draw must not shift the stream
            ShardedEmbedding.__init__(self, out_features, in_features, None, process_group, layout=layout)
        stock = nn.Linear(in_features, out_features, bias=False)  # what the stock decoder draws
        nn.init.normal_(stock.weight, mean=0, std=in_features**-0.5)
        self.load_full_weight(stock.weight.detach())
        self.register_parameter("bias", None)  # as the stock layer, a script may test it
        self.in_features, self.out_features = in_features, out_features
        self.set_output_mode(mode)

    def output_table(self) -> ShardedEmbedding:
        return self

    def forward(self, features: torch.Tensor):  # type: ignore[override]
        return self.project(features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard={self.shard_range}, world_size={self.world_size}, output={self.output_mode}")
