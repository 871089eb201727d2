"""``ShardedEmbedding``: a drop-in ``nn.Embedding`` whose rows are spread over ranks.

Each rank stores only its shard of the table (``.weight``: the rows the plan's layout
gives it, in local order; see :mod:`~embrace_fairseq.core.shard_plan`) and looks up
the rows it needs with AlltoAll (:mod:`~embrace_fairseq.core.input_dist`,
:mod:`~embrace_fairseq.core.output_dist`). Gradients come back the same way, scaled so
that ``.grad`` holds this rank's rows of the data-parallel *average* gradient: exactly
what DDP would leave in a replicated table's ``.grad``.

Why this module is close to 500 lines: it is one class, the ``nn.Module`` face of
every table operation (lookups, the full-table reads, the evaluation replica, the
overlapped table exchange, state-dict resharding, layout changes), each method a few
lines that call the dists;
splitting the class would scatter one object's state over several files. The
module-level helpers at the end find and consolidate the tables of a model.
"""
from __future__ import annotations

import os
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from embrace_fairseq.core import collectives, native_ops
from embrace_fairseq.core.ledger import CommLedger
from embrace_fairseq.core.deferred_grad import DeferredGrads

from embrace_fairseq.core.ids import InvalidIdError, invalid_id_message, validate_ids
from embrace_fairseq.core.input_dist import plan_exchange
from embrace_fairseq.core.node_exchange import plan_node_exchange
from embrace_fairseq.core.node_topology import NodeTopology, check_exchange, node_groups, topology_for
from embrace_fairseq.core.ledger import ledgers_for
from embrace_fairseq.core.output_dist import ShardedLookup
from embrace_fairseq.core.table_dist import (
    PendingGather,
    PendingTableGrads,
    PrefetchedTable,
    gather_full,
    gather_table,
)
from embrace_fairseq.core.agreement import check_same_plan
from embrace_fairseq.core.process_group import ProcessGroup, resolve_group
from embrace_fairseq.core.shard_plan import DEFAULT_LAYOUT, ShardPlan
from embrace_fairseq.core.errors import UserError
from embrace_fairseq.core.initial_table import fairseq_initial_rows

#: Attribute set on every sharded parameter so adapters can find (and skip) them.
SHARDED_ATTR = "embrace_sharded"

#: Environment variable: ``1`` runs the exchange (AlltoAll lookups, collectives on the
#: group's device) even on a world of one rank, where a table is otherwise a plain
#: embedding. For checking the device paths on a single GPU (``scripts/gpu_check.sh``).
FORCE_EXCHANGE_ENV = "EMBRACE_FORCE_EXCHANGE"


def _force_exchange(value: Optional[bool]) -> bool:
    if value is not None:
        return bool(value)
    return os.environ.get(FORCE_EXCHANGE_ENV, "0") not in ("", "0")


class ShardedEmbedding(nn.Module):
    """Vocab-sharded embedding table with AlltoAll lookups.

    ``relaxed``: set by :class:`~embrace_fairseq.core.relaxed_rows.RelaxedRows` when some
    rows' updates may still be in flight; reads of the table wait for them as needed.

    Args:
        num_embeddings: rows of the full table (any size, any world size).
        embedding_dim: columns.
        padding_idx: as in ``nn.Embedding``: a zero row that gets no gradient.
        process_group: ranks the table is sharded over; ``None`` is the default group,
            or a plain local embedding when torch.distributed is not initialised.
        grad_scale: multiplier on the summed gradient rows. ``None`` (default) is
            ``1 / world_size``: the data-parallel average.
        ledger: an extra :class:`CommLedger` to record bytes into (the global one always is).
        overlap_table: overlap the full-table exchange of a tied output projection with
            compute (see :meth:`set_table_overlap`). Collective when true and sharded.
        force_exchange: run the exchange even on one rank (needs torch.distributed
            initialised); ``None`` reads ``EMBRACE_FORCE_EXCHANGE``.
        layout: which rank owns which row, one of ``shard_plan.LAYOUTS``: ``"strided"``
            (default: id ``v`` on rank ``v % N``, balances the exchange of a
            frequency-sorted vocabulary) or ``"contiguous"`` (one id range per rank).
            Full tables (``full_weight``, ``state_dict``, checkpoints) are in vocabulary
            order whatever the layout.
        exchange: the route of lookups, one of ``node_topology.EXCHANGES``: ``"flat"``
            (default: every rank asks every owner directly), ``"node"`` (node-aware, see
            :mod:`~embrace_fairseq.core.node_exchange`; on one node, or with one rank per
            node, it is the flat exchange) or ``"auto"`` (node-aware when the job has
            several nodes of several ranks each). Same rows and gradients either way. The
            default is flat: on the emulated 2 x 2 cluster the node-aware route moved 13 %
            fewer exchange bytes between nodes and was no faster. Tables
            over a subgroup, and lookups under the relaxed dependency, are flat.
            Collective at construction unless ``"flat"`` (the ranks agree on the nodes).
        ranks_per_node: ranks on each node; ``None`` reads ``EMBRACE_RANKS_PER_NODE``,
            then the launcher's ``LOCAL_WORLD_SIZE`` (one node when neither is set).
    """

    relaxed = None  # RelaxedRows or None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        process_group: ProcessGroup = None,
        *,
        grad_scale: Optional[float] = None,
        ledger: Optional[CommLedger] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        overlap_table: bool = False,
        force_exchange: Optional[bool] = None,
        layout: str = DEFAULT_LAYOUT,
        exchange: str = "flat",
        ranks_per_node: Optional[int] = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} must be within the table of {num_embeddings} rows")
            if padding_idx < 0:
                padding_idx += num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.group, self.rank, self.world_size = resolve_group(process_group)
        self.plan = ShardPlan(num_embeddings, self.world_size, layout)
        self.force_exchange = _force_exchange(force_exchange) and self.group is not None
        if self.is_sharded:
            # collective, once per table: a rank with another vocabulary or size stops here
            check_same_plan(self.plan, embedding_dim, padding_idx, self.group)
        self.grad_scale = 1.0 / self.world_size if grad_scale is None else float(grad_scale)
        self.ledger = ledger
        self.set_exchange(exchange, ranks_per_node)
        # this rank's rows of fairseq's draw, the whole table never held at once
        rows = fairseq_initial_rows(num_embeddings, embedding_dim, padding_idx, self.plan.vocab_ids(self.rank), dtype)
        self.weight = nn.Parameter(rows.to(device))
        setattr(self.weight, SHARDED_ATTR, True)
        # lets optimizer-state glue find the table of a parameter without the module
        self.weight._embrace_table = weakref.ref(self)
        self._prefetched: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._consolidated: Optional[Tuple[int, torch.Tensor]] = None
        # overlapped full-table exchange (tied output projection)
        self.overlap_table = False
        self._gather_group = None
        self._table_grads: Optional[PendingTableGrads] = None
        self._pending_gather: Optional[Tuple[int, PendingGather]] = None  # (weight version at issue, gather)
        self._read_full_table = False  # a projection has read the table: lookups prefetch it
        # set by an output layer that picks its path per step: whether this step reads the table
        self.full_table_read_ahead: Optional[Callable[[], Optional[bool]]] = None
        # evaluation replica: (weight version when gathered, full table), see eval_replica()
        self._replica: Optional[Tuple[int, torch.Tensor]] = None
        self._grad_exchange_scope: Optional[Callable[[], ContextManager[None]]] = None
        # the vocab-parallel output layer's table gradient, computed at finish_pending()
        self.deferred_grads = DeferredGrads()
        self.defer_output_grad = False
        self.set_table_overlap(overlap_table)

    # ------------------------------------------------------------------ shape info
    @property
    def shard_range(self) -> Tuple[int, int]:
        """This rank's rows as a plan-order range (vocabulary ids only for the contiguous
        layout: :meth:`vocab_ids` holds them for any layout)."""
        return self.plan.shard_range(self.rank)

    @property
    def layout(self) -> str:
        return self.plan.layout

    def vocab_ids(self) -> torch.Tensor:
        """The vocabulary ids of this rank's rows, in local order."""
        return self.plan.vocab_ids(self.rank, device=self.weight.device)

    @property
    def is_sharded(self) -> bool:
        """Whether lookups go through the exchange (more than one rank, or forced)."""
        return self.world_size > 1 or self.force_exchange

    @property
    def _padding_local(self) -> Optional[int]:
        if self.padding_idx is None or self.plan.owner_of(self.padding_idx) != self.rank:
            return None
        return self.plan.local_index_of(self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        s += f", shard={self.shard_range}, world_size={self.world_size}, layout={self.layout}"
        return s + (", exchange=node" if self.node_aware else "")

    @property
    def node_aware(self) -> bool:
        """Whether lookups take the node-aware route (:mod:`~embrace_fairseq.core.node_exchange`)."""
        return self._node_groups is not None

    # ------------------------------------------------------------------ lookups
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for i, (key, out) in enumerate(self._prefetched):
            if key is ids:
                del self._prefetched[i]
                return out
        return self.forward_many([ids])[0]

    def forward_many(self, ids_list: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Look up several id tensors with a single exchange (e.g. source and target
        tokens of a shared table). Collective when sharded, except in evaluation, which
        reads the local replica (:meth:`eval_replica`)."""
        replica = self.eval_replica()
        if replica is not None:
            return [self._local_lookup(ids, replica) for ids in ids_list]
        if self._overlapping() and self._pending_gather is None and self._reads_full_table_this_step():
            # the first lookup of a step starts the gather its output projection will wait for
            self.prefetch_table()
        if not self.is_sharded:
            return [self._local_lookup(ids, self.weight) for ids in ids_list]
        flat = torch.cat([ids.reshape(-1) for ids in ids_list]) if len(ids_list) > 1 else ids_list[0].reshape(-1)
        if self._node_groups is not None and self.relaxed is None:
            xp = plan_node_exchange(flat, self.plan, self._node_groups, self.ledger)
        else:
            xp = plan_exchange(flat, self.plan, self.group, self.rank, self.ledger, self.topology)
        if self.relaxed is not None:
            self.relaxed.before_lookup(self, xp.requested_local)
            xp.relaxed, xp.table = self.relaxed, self
        xp.grad_scope = self._grad_exchange_scope
        unique_rows = ShardedLookup.apply(self.weight, xp, self.grad_scale, self._padding_local)
        rows = native_ops.expand_rows(unique_rows, xp.inverse)  # backward sums rows per unique id
        outs, offset = [], 0
        for ids in ids_list:
            n = ids.numel()
            outs.append(rows[offset : offset + n].view(*ids.shape, self.embedding_dim))
            offset += n
        return outs

    def _reads_full_table_this_step(self) -> bool:
        """The output layer's answer where it picks its path per step, else whether the
        last step's projection read the full table."""
        ask = self.full_table_read_ahead
        answer = ask() if ask is not None else None
        return self._read_full_table if answer is None else answer

    def _local_lookup(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        bad = validate_ids(ids, self.num_embeddings)
        if bad is not None:
            raise InvalidIdError(invalid_id_message(bad, self.num_embeddings, self.rank))
        return F.embedding(ids, table, self.padding_idx)

    def set_exchange(self, exchange: str, ranks_per_node: Optional[int] = None) -> None:
        """Choose the route of later lookups (see the ``exchange`` argument). Collective
        unless ``"flat"``: every rank calls it, in the same order, between steps."""
        self.exchange = check_exchange(exchange)
        # the job's nodes (for the ledger's inter-node bytes, and the node-aware route)
        self.topology: Optional[NodeTopology] = None
        self._node_groups = None
        if self.is_sharded and (collectives.world_size(), collectives.rank()) == (self.world_size, self.rank):
            try:
                self.topology = topology_for(self.world_size, ranks_per_node)
            except ValueError:
                if self.exchange != "flat":
                    raise
                # nodes of different sizes: the flat exchange needs no topology (the
                # ledger then counts every byte as leaving the node)
            if self.topology is not None and self.exchange != "flat":
                self._node_groups = node_groups(self.topology)  # collective; None on one node

    def set_grad_exchange_scope(self, scope: Optional[Callable[[], ContextManager[None]]]) -> None:
        """Run each backward exchange of looked-up rows' gradients inside ``scope()``
        (``None``: nothing around it). Entered exactly once per exchange: one per
        :meth:`forward_many` call, however many outputs it served (a joint lookup of
        encoder and decoder tokens is one exchange), and left when the shard gradient
        of that exchange is computed, even on an error. Lookups made before the call
        keep the scope they were made with."""
        self._grad_exchange_scope = scope

    def prefetch(self, *ids_list: torch.Tensor) -> None:
        """Run one joint exchange now; the next ``forward`` of each of these exact
        tensors is served from it. Lets the encoder and decoder of a tied table share
        one exchange without changing their code."""
        self._prefetched = list(zip(ids_list, self.forward_many(list(ids_list))))

    def clear_prefetch(self) -> None:
        self._prefetched = []

    def gathered_weight(self) -> torch.Tensor:
        """The full table as a differentiable tensor (all-gather forward, reduce-scatter
        backward), for a tied output projection. Collective when sharded.

        With the table overlap on, the gather is the one :meth:`prefetch_table` started
        (or starts now), and the backward only issues the reduce-scatter: call
        :meth:`finish_pending` before reading ``.grad``.

        In evaluation it is the local replica (:meth:`eval_replica`): no collective."""
        if not self.is_sharded:
            return self.weight
        replica = self.eval_replica()
        if replica is not None:
            return replica
        if not self._overlapping():
            if self.relaxed is not None:
                self.relaxed.before_full_read(self)
            return gather_table(self.weight, self.plan, self.group, self.rank, self.grad_scale, self.ledger)
        self._read_full_table = True
        self.prefetch_table()
        assert self._pending_gather is not None and self._table_grads is not None
        version, pending = self._pending_gather
        self._pending_gather = None
        if version != self.weight._version:
            # the weights changed in place since the gather was issued (every rank alike)
            pending.wait()
            pending = PendingGather(self.weight, self.plan, self._gather_group, ledgers_for(self.ledger))
        return PrefetchedTable.apply(self.weight, pending, self._table_grads)

    # ------------------------------------------------------------------ evaluation replica
    def eval_replica(self) -> Optional[torch.Tensor]:
        """The full table for reads in evaluation, or None outside it.

        Evaluation is the module in eval mode with gradients off (fairseq's validation,
        ``--eval-bleu`` generation, ``fairseq-validate``). The first read there gathers
        the table once (a collective: the first evaluation forward, which every rank
        runs, as each rank runs every validation batch or a dummy one); every later
        lookup and output projection reads the replica locally, so decoding, whose
        number of steps differs by rank, issues no collective. The replica is dropped
        when the module goes back to training (:meth:`train`), and re-gathered if the
        shard changed since (a load): it never serves stale rows.
        """
        if self.training or torch.is_grad_enabled() or not self.is_sharded:
            return None
        if self._replica is None or self._replica[0] != self.weight._version:
            self._replica = None
            full = self.full_weight()  # collective; after pending relaxed rows are applied
            self._replica = (self.weight._version, full)
        return self._replica[1]

    def drop_replica(self) -> None:
        """Forget the evaluation replica (no communication)."""
        self._replica = None

    def train(self, mode: bool = True) -> "ShardedEmbedding":
        # back to training: the next optimizer step changes the shard, the replica goes
        if mode:
            self.drop_replica()
        return super().train(mode)

    # ------------------------------------------------------------------ overlapped table exchange
    def set_table_overlap(self, enabled: bool) -> None:
        """Overlap the full-table exchange of a tied output projection with compute.

        On: the all-gather is issued at the first lookup of a step (or by
        :meth:`prefetch_table`) and awaited by :meth:`gathered_weight`; the backward
        issues the gradient's reduce-scatter and returns, :meth:`finish_pending` adds it
        to ``.grad``. Each runs on its own process group, created here: a collective,
        call it on every rank in the same order. Tables over a subgroup, and tables under
        the relaxed dependency, keep the synchronous exchange.
        """
        enabled = bool(enabled) and self.is_sharded and (
            collectives.world_size(), collectives.rank()) == (self.world_size, self.rank)
        if not enabled:
            if self.overlap_table:
                self.finish_pending()
            self.overlap_table = False
            return
        if self._gather_group is None:
            ranks = list(range(self.world_size))
            self._gather_group = collectives.new_group(ranks)  # created and warmed up now
            grad_group = collectives.new_group(ranks)
            self._table_grads = PendingTableGrads(self.plan, grad_group, self.rank, self.grad_scale, ledgers_for(self.ledger))
        self.overlap_table = True

    def set_defer_output_grad(self, enabled: bool) -> None:
        """Compute the table's gradient from a vocab-parallel output layer at
        :meth:`finish_pending` instead of in its backward (:mod:`.vocab_parallel`,
        "Deferred table gradient"): the layers below start their backward, and their
        dense all-reduce, one large product earlier, and the product runs while that
        all-reduce is in flight. Results are the same. No communication."""
        if not enabled:
            self.deferred_grads.flush()
        self.defer_output_grad = bool(enabled) and self.is_sharded

    def _overlapping(self) -> bool:
        return self.overlap_table and self.relaxed is None and self._table_grads is not None

    def prefetch_table(self) -> None:
        """Start the all-gather of the table now unless one is in flight. Collective (on
        the table's gather group): every rank calls it at the same point of a step, after
        the optimizer step whose weights the projection must see."""
        if not self._overlapping() or self._pending_gather is not None:
            return
        self._table_grads.ledgers = ledgers_for(self.ledger)  # a tracing ledger may have been set since
        self._pending_gather = (
            self.weight._version,
            PendingGather(self.weight, self.plan, self._gather_group, self._table_grads.ledgers),
        )

    def finish_pending(self) -> None:
        """Wait for the table-gradient reduce-scatters in flight and add them to ``.grad``;
        drop a gather issued before this point (the step that follows changes the
        weights). Call on every rank before anything reads ``.grad`` (norm, clipping,
        optimizer). Computes the deferred output-layer gradient first: the dense
        all-reduce is still in flight here in both engines."""
        self.deferred_grads.flush()
        if self._table_grads is not None:
            self._table_grads.finish(self.weight)
        self._drop_prefetched_table()

    def _drop_prefetched_table(self) -> None:
        self.drop_replica()  # called wherever the shard is replaced (loads, layout changes)
        if self._pending_gather is not None:
            self._pending_gather[1].wait()  # every rank issued it: completes without new collectives
            self._pending_gather = None

    # ------------------------------------------------------------------ full table
    def full_weight(self) -> torch.Tensor:
        """The full ``(num_embeddings, embedding_dim)`` table on every rank, in vocabulary
        order. Collective. The call for a script that needs the table whole: ``weight``
        is this rank's shard (marked ``embrace_sharded``), and a tied layer holding it
        under its own ``weight`` has this method too (:mod:`.table_alias`)."""
        if not self.is_sharded:
            return self.weight.detach().clone()
        if self.relaxed is not None:
            self.relaxed.before_full_read(self)
        return gather_full(self.weight, self.plan, self.group, self.rank, self.ledger)

    def gather_shard_state(self, shard_tensor: torch.Tensor) -> torch.Tensor:
        """Full-table version of any tensor shaped like this rank's shard (e.g. an Adam
        moment). Collective."""
        if not self.is_sharded:
            return shard_tensor.detach().clone()
        if self.relaxed is not None:
            self.relaxed.before_full_read(self)
        return gather_full(shard_tensor, self.plan, self.group, self.rank, self.ledger)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows (local order) of a full-table tensor in vocabulary order (no
        communication; a view for the contiguous layout, a copy otherwise)."""
        if full.shape[0] != self.num_embeddings:
            raise ValueError(
                f"expected a full table of {self.num_embeddings} rows, got shape {tuple(full.shape)}"
            )
        return self.plan.shard_rows(full, self.rank)

    @torch.no_grad()
    def load_full_weight(self, full: torch.Tensor) -> None:
        """Keep this rank's rows of a full table (no communication)."""
        if tuple(full.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"expected a table of shape ({self.num_embeddings}, {self.embedding_dim}), got {tuple(full.shape)}"
            )
        self._drop_prefetched_table()
        self.weight.copy_(self.shard_of(full))

    @torch.no_grad()
    def set_layout(self, layout: str) -> None:
        """Re-shard the table under another layout (same rows, other owners). Collective
        (gathers the table, then each rank keeps its new rows; shard sizes do not change,
        so ``.weight`` stays the same parameter). Only before training starts: optimizer
        state or gradients of the old shard would not follow."""
        if layout == self.layout:
            return
        new_plan = ShardPlan(self.num_embeddings, self.world_size, layout)
        if not self.is_sharded:
            self.plan = new_plan
            return
        if (self.weight.grad is not None or len(self.deferred_grads)
                or self._table_grads is not None and len(self._table_grads)):
            raise RuntimeError("set_layout() with gradients pending: change the layout before training starts")
        full = self.full_weight()
        self._drop_prefetched_table()
        check_same_plan(new_plan, self.embedding_dim, self.padding_idx, self.group)
        self.plan = new_plan
        if self._table_grads is not None:
            self._table_grads.plan = new_plan
        self._consolidated = None
        self.weight.copy_(self.shard_of(full))

    # ------------------------------------------------------------------ state dict
    def consolidate(self) -> torch.Tensor:
        """Gather the full table and keep it for the next ``state_dict``. Collective:
        call on every rank before a rank-0-only save."""
        full = self.full_weight()
        self._consolidated = (self.weight._version, full)
        return full

    def release_consolidated(self) -> None:
        """Forget the full table :meth:`consolidate` kept (no communication)."""
        self._consolidated = None

    def _save_to_state_dict(self, destination: Dict, prefix: str, keep_vars: bool) -> None:
        if not self.is_sharded:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._consolidated is None or self._consolidated[0] != self.weight._version:
            raise RuntimeError(
                f"state_dict() of a ShardedEmbedding spread over {self.world_size} ranks needs the full "
                "table: call embrace_fairseq.consolidate(model) on every rank first (it is a collective; "
                "the full table alone: full_weight() of the module whose .weight is the shard)"
            )
        destination[prefix + "weight"] = self._consolidated[1]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        self._drop_prefetched_table()
        key = prefix + "weight"
        if key in state_dict and state_dict[key].dim() >= 1:
            check_table_rows(key, state_dict[key].shape[0], self.num_embeddings,
                             self.weight.shape[0] if self.is_sharded else None)
        if key in state_dict and self.is_sharded:
            tensor = state_dict[key]
            if tensor.shape[0] == self.num_embeddings:
                state_dict = dict(state_dict)
                state_dict[key] = self.shard_of(tensor)
            elif tensor.shape[0] != self.weight.shape[0]:
                error_msgs.append(
                    f"{key}: a sharded table of {self.num_embeddings} rows can load the full table or this "
                    f"rank's shard of {self.weight.shape[0]} rows, not {tuple(tensor.shape)}"
                )
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


class TableSizeMismatch(UserError, ValueError):
    """A checkpoint's table has another number of rows than the model's dictionary gives."""


def check_table_rows(key: str, rows: int, num_embeddings: int, shard_rows: Optional[int] = None) -> None:
    """Stop a load whose table does not match the dictionary, naming both sizes and the
    usual cause (every rank loads the same file, so every rank stops here). A sharded
    table also loads its own shard (``shard_rows``)."""
    if rows == num_embeddings or (shard_rows is not None and rows == shard_rows):
        return
    raise TableSizeMismatch(
        f"{key}: the checkpoint's table has {rows} rows but this model's dictionary has {num_embeddings} "
        f"entries (one row per entry). The model is being built with another dictionary than the one the "
        f"checkpoint was trained with: use the checkpoint's own dict.txt (and binarise the data with it: "
        f"fairseq-preprocess --srcdict), and the same symbols the task adds to it: mBART's --langs (one "
        f"[xx_XX] token per language), <mask> of masked_lm / denoising."
    )


def sharded_embeddings(module: nn.Module) -> List[ShardedEmbedding]:
    """Every distinct ShardedEmbedding inside ``module`` (tied tables appear once)."""
    seen, out = set(), []
    for m in module.modules():
        if isinstance(m, ShardedEmbedding) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def consolidate(module: nn.Module) -> None:
    """Gather every sharded table of ``module`` for the next ``state_dict``. Collective."""
    for emb in sharded_embeddings(module):
        emb.consolidate()


def release_consolidated(module: nn.Module) -> None:
    """Drop the full tables :func:`consolidate` kept (after the save that needed them):
    no rank holds a full table between saves."""
    for emb in sharded_embeddings(module):
        emb.release_consolidated()


def job_topology(tables: Sequence[ShardedEmbedding]) -> Optional[NodeTopology]:
    """The job's nodes as the tables see them (the first table spanning the job), for
    the dense all-reduce; None without one."""
    return next((emb.topology for emb in tables if emb.topology is not None), None)


def finish_pending(tables) -> None:
    """:meth:`ShardedEmbedding.finish_pending` for every table of a module (or a list of
    tables). Call on every rank before reading gradients."""
    if isinstance(tables, nn.Module):
        tables = sharded_embeddings(tables)
    for emb in tables:
        emb.finish_pending()


def is_sharded_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, SHARDED_ATTR, False))


def table_of(p: torch.Tensor) -> Optional[ShardedEmbedding]:
    """The ShardedEmbedding whose shard ``p`` is, or None."""
    ref = getattr(p, "_embrace_table", None)
    return ref() if ref is not None else None
