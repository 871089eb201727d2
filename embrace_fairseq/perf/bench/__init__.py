"""Benchmark of EmbRace against the stock data-parallel paths on an emulated cluster.

``python -m embrace_fairseq.perf.bench [--quick]`` (see :mod:`.__main__`). Parts:
:mod:`.netem_cluster` (ranks in network namespaces on rate-limited links),
:mod:`.workloads` (the two fairseq models and their batches), :mod:`.strategies`
(the five ways to train them), :mod:`.comm_count` (bytes of the stock paths'
collectives), :mod:`.worker` (one rank), :mod:`.report` (JSON, Markdown, plots).
"""

# The strategies as named in bench.json (here, so that importing names costs no torch).
STRATEGIES = ("fairseq_legacy_ddp", "fairseq_c10d", "deepspeed", "sparse_allgather",
              "embrace_noschedule", "embrace_schedule")
EMBRACE = ("embrace_noschedule", "embrace_schedule")
