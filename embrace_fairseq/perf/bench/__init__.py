"""Benchmark of EmbRace against the stock data-parallel paths on an emulated cluster.

``python -m embrace_fairseq.perf.bench [--quick]`` (see :mod:`.__main__`). Parts:
:mod:`.netem_cluster` (ranks in network namespaces on rate-limited links),
:mod:`.workloads` (the two fairseq models and their batches), :mod:`.builders`
(the ways to train them; each registered with its strategy in
:mod:`embrace_fairseq.perf.strategies`), :mod:`.comm_count` (bytes of the stock
paths' collectives), :mod:`.worker` (one rank), :mod:`.report` (the JSON),
:mod:`.markdown` and :mod:`.plots` (the report), :mod:`.keys` (run names).
"""
