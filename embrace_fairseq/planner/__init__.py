"""The per-table plan: replicate, row-shard or vocab-parallel, chosen by a cost model.

Whether vocab sharding pays depends on the model and the cluster (the table's share of
the parameters, its rows against the tokens a step looks up, tied or untied output, the
link against the compute). The planner prices every choice with the analytic cost model
the simulator uses and keeps the cheapest; replicating every table (the stock path) is
one of the candidates, so the chosen plan is never predicted slower than stock.

Modules: :mod:`.inputs` (what the plan is decided from: tables, dense bytes, tokens,
world, rates), :mod:`.network` (the alpha-beta link), :mod:`.link` (collectives on one
link), :mod:`.volume` (bytes per step by strategy), :mod:`.cost` (bytes and step time of
one plan), :mod:`.plan` (the choices, their enumeration, explicit plans),
:mod:`.probe` (the rates measured on the ranks, the same on every rank).
"""
