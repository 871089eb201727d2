"""Performance analysis and demonstrations (top layer; nothing imports it).

:mod:`.strategies` (the data-parallel strategies, each registered once with its byte
formula, simulator cost, benchmark builder, label and aliases; the byte formulas are
the planner's, :mod:`embrace_fairseq.planner.volume`), :mod:`.bounds` (analytic byte
minimum per strategy for given ids),
:mod:`.simulator` (alpha-beta cost model, a subpackage), :mod:`.bench` (the
emulated-cluster benchmark), :mod:`.native_bench` (native ops against their
references), :mod:`.demo` and :mod:`.hidden_share`. The ring-collective byte formulas
are in :mod:`embrace_fairseq.core.ring_volume`.
"""
