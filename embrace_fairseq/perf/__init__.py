"""Performance analysis and demonstrations (top layer; nothing imports it).

:mod:`.strategies` (the data-parallel strategies, registered once), :mod:`.bounds`
(analytic byte minimum per strategy), :mod:`.simulator` (alpha-beta cost model),
:mod:`.bench` (the emulated-cluster benchmark), :mod:`.native_bench` (native ops against
their references), :mod:`.demo` and :mod:`.hidden_share`.
"""
