"""What a model costs on one rank (:class:`Profile`) and the engines' knobs (:class:`Options`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from embrace_fairseq.perf.simulator.sparse_loads import NodeLoads, SparseLoads, node_loads, sparse_loads


@dataclass
class Profile:
    """What the model costs on one rank; the benchmark's ``profiles`` entries.

    ``dense_layers`` are in forward order (input first), every replicated parameter
    except the token table. ``tied_output``: ``None``, ``"gather"`` (the output
    projection reads the full table through an all-gather, its gradient a
    reduce-scatter) or ``"vocab_parallel"`` (hidden states and softmax statistics
    exchanged instead, docs/DESIGN.md); EmbRace's models choose between the two per
    step from the token counts. ``output_tokens_per_rank``: the tokens the output layer
    scores where fewer than ``tokens_per_rank`` (a masked LM's masked positions; None: all).
    A model of several token tables (an encoder's and a decoder's) is one table of their
    rows together, in one id space (the bench's profiles say so).
    """

    name: str
    vocab: int
    dim: int
    dense_layers: List[Tuple[str, int]]
    tokens_per_rank: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    unique_ids_per_rank: Dict[int, List[float]] = field(default_factory=dict)
    tied_output: Optional[str] = None
    element_size: int = 4
    id_size: int = 4
    zipf_s: float = 1.0
    output_tokens_per_rank: Optional[float] = None  # tokens scored by the output layer

    @property
    def dense_numel(self) -> int:
        return sum(n for _, n in self.dense_layers)

    @property
    def table_bytes(self) -> float:
        return float(self.vocab) * self.dim * self.element_size

    def loads(self, world_size: int, layout: str = "contiguous") -> SparseLoads:
        key = (world_size, layout, self.vocab, self.tokens_per_rank, self.zipf_s)
        cache = self.__dict__.setdefault("_loads_cache", {})
        if key not in cache:
            cache[key] = self._loads(world_size, layout)
        return cache[key]

    def node_loads(self, world_size: int, ranks_per_node: int, layout: str = "contiguous") -> NodeLoads:
        """The node-aware exchange's two hops for the per-rank draws of :meth:`loads`."""
        key = ("node", world_size, ranks_per_node, layout, self.vocab, self.tokens_per_rank, self.zipf_s)
        cache = self.__dict__.setdefault("_loads_cache", {})
        if key not in cache:
            cache[key] = node_loads(self.vocab, world_size, ranks_per_node, self.loads(world_size, layout),
                                    zipf_s=self.zipf_s, layout=layout)
        return cache[key]

    def _loads(self, world_size: int, layout: str) -> SparseLoads:
        measured = self.unique_ids_per_rank.get(world_size)
        if measured is None and self.unique_ids_per_rank:
            # unique ids per rank depend on the tokens per rank, not on N: any N will do
            measured = self.unique_ids_per_rank[min(self.unique_ids_per_rank)]
        return sparse_loads(
            self.vocab, world_size, tokens_per_rank=self.tokens_per_rank, unique_per_rank=measured,
            zipf_s=self.zipf_s, layout=layout,
        )

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Profile":
        try:
            compute = d["compute_s"]
            return cls(
                name=name,
                vocab=int(d["vocab"]),
                dim=int(d["dim"]),
                dense_layers=[(str(x["name"]), int(x["numel"])) for x in d["dense_layers"]]
                or [("dense", int(d["dense_numel"]))],
                tokens_per_rank=float(d["tokens_per_rank"]),
                forward_s=float(compute["forward"]),
                backward_s=float(compute["backward"]),
                optimizer_s=float(compute.get("optimizer", 0.0)),
                unique_ids_per_rank={int(k): [float(u) for u in v] for k, v in d.get("unique_ids_per_rank", {}).items()},
                tied_output=d.get("tied_output") or None,
                element_size=int(d.get("element_size", 4)),
                id_size=int(d.get("id_size", 4)),
                zipf_s=float(d.get("zipf_s", 1.0)),
                # a masked LM scores a share of the positions it looks up
                output_tokens_per_rank=(float(d["output_tokens_per_rank"])
                                        if d.get("output_tokens_per_rank") is not None else None),
            )
        except KeyError as exc:
            raise ValueError(f"profile {name!r} lacks the field {exc}") from None


@dataclass(frozen=True)
class Options:
    """Bucket and piece sizes of each engine (bytes unless said)."""

    legacy_ddp_buffer_numel: int = 2**28  # fairseq LegacyDistributedDataParallel
    c10d_bucket_bytes: int = 25 << 20  # fairseq --bucket-cap-mb 25
    deepspeed_bucket_numel: int = 500_000_000  # reduce_bucket_size
    zero_bucket_numel: int = 25 * 2**20 // 4  # the ZeRO baselines' tuned reduce/allgather_bucket_size
    embrace_bucket_bytes: int = 4 << 20  # ScheduleOptions defaults
    embrace_piece_bytes: int = 1 << 20
    defer_rows: bool = True  # relaxed embedding dependency
    shard_layout: str = "strided"  # ShardPlan layout, the EmbRace default; "contiguous" the alternative
    # tied output (gather): as built, the all-gather runs when the output projection
    # does and the reduce-scatter inside the backward; True models them prefetched /
    # deferred to the optimizer (a what-if)
    overlap_table: bool = False
