"""Core: the framework-agnostic algorithm (no fairseq, no DeepSpeed).

Shard plan (:mod:`.shard_plan`), process groups (:mod:`.process_group`), start-up
agreement on a plan (:mod:`.agreement`), the exchange split TorchRec-style into input
dist (:mod:`.input_dist`: ids to owners), output dist (:mod:`.output_dist`: rows back,
gradient rows out) and full-table dist (:mod:`.table_dist`), the row ops they run
locally (:mod:`.native_ops`), :class:`~.sharded_embedding.ShardedEmbedding`, the tied
output projection (:mod:`.tied_projection`), gradients computed after their backward
(:mod:`.deferred_grad`), the relaxed embedding dependency
(:mod:`.relaxed_rows`), byte accounting (:mod:`.ledger`) and the timeline (:mod:`.trace`).
Nothing here imports from a higher layer (optim, schedule, guards, adapters, perf).
"""
